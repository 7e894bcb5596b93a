"""Named operators and the read token: what a person does is recorded as operator:NAME; with a read token set,
every GET but the probes, the scrape and static files needs a token; the pages log in once with a form into a
signed session cookie. Real gunicorn, the real `trainmedic serve`, the Flask app on a real redis-server."""
from __future__ import annotations

import base64
import json
import os
import re
import stat
import subprocess
import time
import sys
import zlib
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import redis
import requests

from trainmedic.client.settings import SettingsError
from trainmedic.client.wire import keys
from trainmedic.service import goodput
from trainmedic.service.cli.serve import add_person_lines
from trainmedic.service.embedded_redis import free_port
from trainmedic.service.people import People
from trainmedic.service.settings import ServiceSettings

from tests.conftest import AUTH, OP_AUTH, OPERATOR, ROOT, SIGNING_KEY, TOKEN, load_fixture, post_json

ALICE = "alice-token-" + "a1b2c3d4" * 3
BOB = "bob-token-" + "e5f6a7b8" * 3
READ = "read-token-" + "c9d0e1f2" * 3
TOKENS = f"""# people of the training platform team
alice {ALICE}
bob.smith@example.org {BOB}   # on call this week
"""
SECRETS = (ALICE, BOB, READ, OPERATOR, TOKEN)
JOB = "llama-people"
HELD = """
playbooks:
  - name: held-lr
    matchers: ['alertname="NeedsAPerson"']
    target: job
    approval: true
    actions:
      - scale_lr: {factor: 0.5, min_lr: 1.0e-7}
"""
CLI = [sys.executable, "-m", "trainmedic.service.cli"]
CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith("TRAINMEDIC_")}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def tokens_file(tmp_path: Path) -> Path:
    path = tmp_path / "operators.tokens"
    path.write_text(TOKENS)
    path.chmod(0o600)
    return path


@pytest.fixture
def held_playbooks(tmp_path: Path) -> Path:
    path = tmp_path / "held.yaml"
    path.write_text(HELD)
    return path


# -- who did what

def test_named_tokens_are_recorded_as_operator_name_on_approve_reject_triggers_and_commands(
        gunicorn: Any, tokens_file: Path, held_playbooks: Path) -> None:
    g = gunicorn(2, TRAINMEDIC_OPERATOR_TOKENS_FILE=str(tokens_file), TRAINMEDIC_PLAYBOOKS=str(held_playbooks))

    def post(path: str, body: dict, token: str) -> dict:
        resp = requests.post(g.url + path, json=body, headers=bearer(token), timeout=10)
        assert resp.status_code in (200, 201), (path, resp.text)
        return dict(resp.json())

    trigger = {"playbook": "held-lr", "labels": {"job_name": JOB}}
    first, second, third = (post("/remediations", trigger, t) for t in (ALICE, BOB, OPERATOR))
    assert [r["requested_by"] for r in (first, second, third)] == [
        "operator:alice", "operator:bob.smith@example.org", "operator"]
    assert all(r["status"] == "pending_approval" for r in (first, second, third))
    approved = post(f"/remediations/{first['id']}/approve", {"comment": "checked the loss curve"}, BOB)
    assert approved["approved_by"] == "operator:bob.smith@example.org" and approved["status"] == "dispatched"
    rejected = post(f"/remediations/{second['id']}/reject", {}, ALICE)
    assert rejected["rejected_by"] == "operator:alice" and rejected["reason"] == "rejected"
    single = post(f"/remediations/{third['id']}/approve", {}, OPERATOR)
    assert single["approved_by"] == "operator"  # the one shared token stays plain "operator"
    command = post("/commands", {"target": f"job:{JOB}", "action": "set_lr", "params": {"lr": 0.001}}, ALICE)
    assert command["requested_by"] == "operator:alice" and command["playbook"] == "manual"
    # As stored: read back through the API and the record's page.
    stored = requests.get(f"{g.url}/remediations/{first['id']}", timeout=10).json()
    assert (stored["requested_by"], stored["approved_by"]) == ("operator:alice", "operator:bob.smith@example.org")
    page = requests.get(f"{g.url}/records/{second['id']}", timeout=10).text
    assert "by operator:alice at" in page
    # The document says what the records hold (requested_by may be operator:NAME).
    pattern = requests.get(g.url + "/openapi.json", timeout=10).json()[
        "components"]["schemas"]["Record"]["properties"]["requested_by"]["pattern"]
    assert re.search(pattern, "operator:bob.smith@example.org") and not re.search(pattern, "operator:a b")
    # A wrong token, the read token or the webhook token acts as nobody.
    for token, status in (("x" * 30, 401), (TOKEN, 403)):
        resp = requests.post(g.url + "/commands", json={"target": f"job:{JOB}", "action": "set_lr",
                                                        "params": {"lr": 0.1}}, headers=bearer(token), timeout=10)
        assert resp.status_code == status, resp.text
    assert len(requests.get(g.url + "/history", timeout=10).json()["items"]) == 4
    g.stop()
    log = g.log.name
    text = Path(log).read_text(errors="replace")
    assert not [s for s in SECRETS if s in text], "a token reached the service's log"


# -- reads

@pytest.fixture
def closed(make_app: Any, r: Any, tokens_file: Path, held_playbooks: Path) -> Any:
    """An app whose reads need a token, with one held record and its job's account; returns (app, record id)."""
    app = make_app(read_token=READ, operator_tokens_file=str(tokens_file), playbooks=str(held_playbooks))
    seen(r)
    made = post_json(app.test_client(), "/remediations", {"playbook": "held-lr", "labels": {"job_name": JOB}})
    assert made.status_code == 201
    return app, made.get_json()["id"]


def seen(r: Any) -> None:
    """The job's goodput account, from one heartbeat of its training process (so that /jobs/NAME serves it)."""
    now = time.time()
    beat = {"kind": "job", "name": JOB, "step": 3, "last_seen": now,
            "goodput": {"run": "r1", "started": now - 10, "productive_s": 5.0, "recompute_s": 0.0, "stall_s": 0.0,
                        "first_step": 1, "high": 3, "back": None}}
    goodput.fold(r, [(keys.Target("job", JOB), beat)], now)


def get_routes(app: Any, rid: str) -> dict[str, str]:
    """Every GET route of the app (its url_map, so a new route is covered), as a path to request -> endpoint."""
    samples = {"rid": rid, "kind": "job", "name": JOB, "filename": "trainmedic.css"}
    out = {}
    for rule in app.url_map.iter_rules():
        if "GET" not in rule.methods:
            continue
        missing = set(rule.arguments) - set(samples)
        assert not missing, f"a sample value for {missing} of {rule.rule} is needed here"
        out[re.sub(r"<(?:[^:>]+:)?([^>]+)>", lambda m: samples[m.group(1)], rule.rule)] = rule.endpoint
    return out


OPEN = {"/healthz", "/readyz", "/metrics", "/static/trainmedic.css", "/login", "/login/session"}


def test_a_read_token_guards_every_get_route_but_the_probes_the_scrape_static_files_and_the_login_form(
        closed: Any) -> None:
    app, rid = closed
    http = app.test_client()
    routes = get_routes(app, rid)
    assert OPEN < set(routes) and {"/", "/history", f"/remediations/{rid}", f"/records/{rid}", "/targets",
                                   f"/targets/job/{JOB}", "/playbooks", "/openapi.json"} < set(routes)
    for path, endpoint in routes.items():
        if path in OPEN:
            for method in (http.get, http.head):
                assert method(path).status_code == 200, path
            continue
        for method in ("GET", "HEAD"):
            resp = http.open(path, method=method)
            if endpoint.startswith("ui."):  # a page for people: to the login form, coming back afterwards
                assert resp.status_code == 303, (path, method)
                assert resp.headers["Location"] == "/login?next=" + path, resp.headers["Location"]
            else:
                assert resp.status_code == 401, (path, method, resp.status_code)
                assert resp.headers["WWW-Authenticate"].startswith("Bearer")
                if method == "GET":
                    assert "read token" in resp.get_json()["error"]
        for token, status in (("not-a-token-at-all", 401), (TOKEN, 403), ("", None)):
            resp = http.get(path, headers=bearer(token) if token else {"Authorization": "Basic eDp5"})
            assert resp.status_code == (status or (303 if endpoint.startswith("ui.") else 401)), (path, token)
            if status == 403:
                assert "webhook token" in resp.get_json()["error"]
        for token in (READ, ALICE, BOB, OPERATOR):
            resp = http.get(path, headers=bearer(token))
            assert resp.status_code == 200, (path, token[:5], resp.status_code)
    # Writes are not reads: the read token approves nothing.
    resp = post_json(http, f"/remediations/{rid}/approve", {}, headers=bearer(READ))
    assert resp.status_code == 403 and "read token" in resp.get_json()["error"]


def test_without_a_read_token_every_get_route_is_open(make_app: Any, r: Any, tokens_file: Path,
                                                     held_playbooks: Path) -> None:
    app = make_app(operator_tokens_file=str(tokens_file), playbooks=str(held_playbooks))
    seen(r)
    http = app.test_client()
    rid = post_json(http, "/remediations", {"playbook": "held-lr", "labels": {"job_name": JOB}}).get_json()["id"]
    for path in get_routes(app, rid):
        assert http.get(path).status_code == 200, path
    page = http.get("/").text
    assert 'class="who" href="/login?next=/"' in page  # a person can still log in, to approve as themselves


# -- the pages' login

def login_form(http: Any) -> str:
    """The login form's CSRF value, as a browser gets the form (a person logged in may log in as another)."""
    resp = http.get("/login")
    assert resp.status_code == 200 and resp.headers["Cache-Control"] == "no-store"
    assert "http-equiv" not in resp.text  # the form at once: no page that loads another
    form = re.search(r'<form[^>]*id="login"[^>]*>', resp.text)
    assert form and 'method="post"' in form.group(0)
    assert re.search(r'<input type="password" name="token"', resp.text)
    found = re.search(r'name="csrf" value="([^"]+)"', resp.text)
    assert found
    return found.group(1)


def log_in(http: Any, token: str, next_path: str = "/", **kw: Any) -> Any:
    csrf = login_form(http)
    return http.post("/login", data={"csrf": csrf, "token": token, "next": next_path}, **kw)


def session_cookie(resp: Any) -> str:
    [cookie] = [v for k, v in resp.headers.items() if k == "Set-Cookie" and v.startswith("trainmedic_session=")]
    return str(cookie)


def attributes(cookie: str) -> set[str]:
    return {part.strip().split("=")[0].lower() for part in cookie.split(";")[1:]}


def payload(cookie: str) -> dict:
    """What a signed session cookie says (itsdangerous: base64 JSON, zlib-compressed when it starts with a dot)."""
    value = cookie.split(";")[0].split("=", 1)[1]
    compressed = value.startswith(".")
    data = value.lstrip(".").split(".")[0]
    raw = base64.urlsafe_b64decode(data + "=" * (-len(data) % 4))
    return dict(json.loads(zlib.decompress(raw) if compressed else raw))


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.urls += [v or "" for k, v in attrs if k in ("href", "src", "action", "formaction")]


def test_the_login_form_sets_a_signed_httponly_samesite_strict_session_that_names_the_person(closed: Any) -> None:
    app, rid = closed
    http = app.test_client()
    resp = log_in(http, ALICE, f"/records/{rid}")
    assert resp.status_code == 303 and resp.headers["Location"] == f"/records/{rid}"
    cookie = session_cookie(resp)
    assert {"httponly", "path", "samesite"} <= attributes(cookie) and "secure" not in attributes(cookie)  # http
    assert "SameSite=Strict" in cookie and "Path=/" in cookie
    assert "expires" not in attributes(cookie)  # a session cookie: gone when the browser closes
    said = payload(cookie)
    assert said["who"] == "operator:alice" and set(said) == {"who", "fp", "csrf"}
    assert not [s for s in SECRETS if s in cookie or s in json.dumps(said)], "the cookie holds a token"
    page = http.get(f"/records/{rid}")
    assert page.status_code == 200 and re.search(r'<form class="who"[^>]*data-csrf="[^"]+">alice ', page.text)
    assert http.get("/history").status_code == 200  # the API reads with the page's login too
    # The page's own writes act as that person, with the session's CSRF value in a header.
    csrf = re.search(r'data-csrf="([^"]+)"', page.text).group(1)  # type: ignore[union-attr]
    refused = post_json(http, f"/remediations/{rid}/approve", {}, headers={})
    assert refused.status_code == 403 and "X-CSRF-Token" in refused.get_json()["error"]
    refused = post_json(http, f"/remediations/{rid}/approve", {}, headers={"X-CSRF-Token": csrf[:-1] + "x"})
    assert refused.status_code == 403
    done = post_json(http, f"/remediations/{rid}/approve", {"comment": "from the page"}, headers={"X-CSRF-Token": csrf})
    assert done.status_code == 200 and done.get_json()["approved_by"] == "operator:alice"


def test_a_link_from_another_site_shows_the_form_at_once_and_keeps_the_login_it_arrives_without(
        closed: Any) -> None:
    app, rid = closed
    http = app.test_client()
    assert log_in(http, ALICE).status_code == 303
    cookie = http.get_cookie("trainmedic_session").value  # type: ignore[union-attr]
    # A link from a chat or a notification: the browser leaves the SameSite=Strict cookie out of that request.
    other_site = app.test_client()
    cross = {"Sec-Fetch-Site": "cross-site"}
    resp = other_site.get(f"/records/{rid}", headers=cross)
    assert resp.status_code == 303 and resp.headers["Location"] == f"/login?next=/records/{rid}"
    resp = other_site.get(resp.headers["Location"], headers=cross)
    # The login form at once, which writes no session cookie (that would replace the one held)...
    assert resp.status_code == 200 and 'id="login"' in resp.text and "http-equiv" not in resp.text
    assert not [v for k, v in resp.headers.items() if k == "Set-Cookie" and v.startswith("trainmedic_session=")]
    # ...and whose script asks this site, which the browser sends the cookie to, whether it holds a login.
    check = re.search(r'<body data-session-check="([^"]+)" data-next="([^"]+)">', resp.text)
    assert check and check.groups() == ("/login/session", f"/records/{rid}")
    assert other_site.get("/login/session").get_json() == {"logged_in": False}
    other_site.set_cookie("trainmedic_session", cookie)
    answer = other_site.get("/login/session")
    assert answer.get_json() == {"logged_in": True} and answer.headers["Cache-Control"] == "no-store"
    assert other_site.get(f"/records/{rid}").status_code == 200  # where the script then goes
    # Within this site (the cookie sent, or no cross-site request) there is nothing to ask.
    assert "data-session-check" not in other_site.get(f"/records/{rid}", headers=cross).text
    assert "data-session-check" not in app.test_client().get("/login", headers={"Sec-Fetch-Site": "same-origin"}).text


def test_the_session_cookie_is_secure_behind_https(closed: Any, make_app: Any, tokens_file: Path) -> None:
    app, _ = closed
    over_https = app.test_client()
    csrf = re.search(r'name="csrf" value="([^"]+)"',  # type: ignore[union-attr]
                     over_https.get("/login", base_url="https://localhost").text).group(1)
    resp = over_https.post("/login", data={"csrf": csrf, "token": READ, "next": "/"}, base_url="https://localhost")
    assert resp.status_code == 303 and "secure" in attributes(session_cookie(resp))
    # Behind a proxy that ends TLS, TRAINMEDIC_PUBLIC_URL says people use https.
    proxied = make_app(read_token=READ, operator_tokens_file=str(tokens_file),
                       public_url="https://trainmedic.example.org").test_client()
    resp = log_in(proxied, BOB)
    assert resp.status_code == 303 and "secure" in attributes(session_cookie(resp))


def test_no_token_is_ever_in_a_url_and_a_token_in_a_url_logs_nobody_in(closed: Any) -> None:
    app, rid = closed
    http = app.test_client()
    seen: list[str] = []
    for path in ("/", f"/records/{rid}", f"/targets/job/{JOB}", "/?playbook=held-lr"):
        resp = http.get(path)
        seen.append(resp.headers["Location"])
    for token in (ALICE, READ):
        resp = log_in(http, token, f"/records/{rid}")
        seen.append(resp.headers["Location"])
        for path in ("/", f"/records/{rid}", f"/targets/job/{JOB}", "/login"):
            page = http.get(path)
            assert page.status_code == 200, path
            links = _Links()
            links.feed(page.text)
            assert links.urls, path
            seen += links.urls
        seen.append(http.post("/logout").headers["Location"])
    assert len(seen) > 20
    leaked = [u for u in seen for s in SECRETS if s in u]
    assert leaked == [], leaked
    # A token in the query string is no login, and a login form's token in the query string is not read.
    fresh = app.test_client()
    assert fresh.get(f"/history?token={READ}").status_code == 401
    assert fresh.get(f"/login?token={READ}&next=/").status_code == 200
    assert fresh.get("/").status_code == 303
    csrf = login_form(fresh)
    resp = fresh.post(f"/login?token={READ}", data={"csrf": csrf, "next": "/"})
    assert resp.status_code == 401 and fresh.get("/").status_code == 303


def test_logging_out_clears_the_cookie_and_the_pages_ask_again(closed: Any) -> None:
    app, _ = closed
    http = app.test_client()
    assert log_in(http, ALICE).status_code == 303 and http.get("/").status_code == 200
    resp = http.post("/logout")
    assert resp.status_code == 303 and resp.headers["Location"] == "/login"
    cleared = session_cookie(resp)
    assert cleared.startswith("trainmedic_session=;") and "Max-Age=0" in cleared
    assert {"httponly", "samesite"} <= attributes(cleared)
    assert http.get_cookie("trainmedic_session") is None
    assert http.get("/").status_code == 303 and http.get("/history").status_code == 401


def test_a_wrong_token_a_stale_form_or_another_site_logs_nobody_in(closed: Any) -> None:
    app, rid = closed
    http = app.test_client()
    for token, status, words in (("not-one-of-ours-0123456789", 401, "read or operator tokens"),
                                 (TOKEN, 403, "webhook token"), ("", 401, "Type a token")):
        resp = log_in(http, token)
        assert resp.status_code == status and words in resp.text, token
        assert "trainmedic_session" not in resp.headers.get("Set-Cookie", "") or "who" not in payload(
            session_cookie(resp))
        assert http.get("/").status_code == 303
    # A form that did not come from this service's own login page (no session's CSRF value).
    other = app.test_client()
    resp = other.post("/login", data={"csrf": "guessed", "token": ALICE, "next": "/"})
    assert resp.status_code == 403 and "expired" in resp.text and other.get("/").status_code == 303
    # Another site's page posting the form: refused by Origin before anything is read.
    csrf = login_form(other)
    resp = other.post("/login", data={"csrf": csrf, "token": ALICE, "next": "/"},
                      headers={"Origin": "http://evil.example"})
    assert resp.status_code == 403 and other.get("/").status_code == 303
    # Somewhere else to go afterwards is refused: only this service's own paths.
    for bad in ("//evil.example/x", "https://evil.example/", "/\\evil.example", "javascript:alert(1)"):
        csrf = login_form(other)
        resp = other.post("/login", data={"csrf": csrf, "token": READ, "next": bad})
        assert resp.status_code == 303 and resp.headers["Location"] == "/", bad
    # A read-only login reads, and cannot approve.
    page = other.get(f"/records/{rid}").text
    assert '">read only <button' in page
    csrf = re.search(r'data-csrf="([^"]+)"', page).group(1)  # type: ignore[union-attr]
    resp = post_json(other, f"/remediations/{rid}/approve", {}, headers={"X-CSRF-Token": csrf})
    assert resp.status_code == 403 and "read token" in resp.get_json()["error"]


def test_a_session_ends_when_its_persons_token_changes_or_is_removed(closed: Any, make_app: Any, tokens_file: Path,
                                                                     tmp_path: Path) -> None:
    app, _ = closed
    http = app.test_client()
    assert log_in(http, ALICE).status_code == 303
    cookie = http.get_cookie("trainmedic_session").value  # type: ignore[union-attr]
    # The same service restarted with alice's token rotated (and bob removed): her cookie no longer reads.
    rotated = tmp_path / "rotated.tokens"
    rotated.write_text(f"alice {ALICE[:-4]}zzzz\n")
    again = make_app(read_token=READ, operator_tokens_file=str(rotated)).test_client()
    again.set_cookie("trainmedic_session", cookie)
    assert again.get("/").status_code == 303 and again.get("/history").status_code == 401
    # Unchanged, it does (the session is signed with a secret derived from the signing key, shared by replicas).
    replica = make_app(read_token=READ, operator_tokens_file=str(tokens_file)).test_client()
    replica.set_cookie("trainmedic_session", cookie)
    assert replica.get("/").status_code == 200
    # A cookie signed with another secret is nobody.
    other_key = make_app(read_token=READ, operator_tokens_file=str(tokens_file),
                         signing_key="another-signing-key-" + "9" * 32).test_client()
    other_key.set_cookie("trainmedic_session", cookie)
    assert other_key.get("/").status_code == 303


# -- a bad tokens file, refused at start

BAD_FILES = [
    ("alice\n", 1, "a line is `NAME TOKEN`"),
    (f"# ok\nalice {ALICE} extra\n", 2, "not 3 fields"),
    (f"al/ice {ALICE}\n", 1, "the name must be 1 to 64 letters, digits or _.@-"),
    (f"{'a' * 65} {ALICE}\n", 1, "the name must be 1 to 64"),
    ("alice short-token\n", 1, "shorter than 16 characters"),
    (f"alice {ALICE}\n\nalice {BOB}\n", 3, "the name alice is already on line 1"),
    (f"alice {ALICE}\nbob {ALICE}\n", 2, "the token is already on line 1"),
]


@pytest.mark.parametrize("text, line, words", BAD_FILES)
def test_a_tokens_file_with_a_bad_line_is_refused_naming_the_line(tmp_path: Path, text: str, line: int,
                                                                  words: str) -> None:
    path = tmp_path / "operators.tokens"
    path.write_text(text)
    with pytest.raises(SettingsError) as caught:
        People.from_settings(ServiceSettings(operator_tokens_file=str(path)))
    message = str(caught.value)
    assert message.startswith(f"TRAINMEDIC_OPERATOR_TOKENS_FILE {path}, line {line}: ") and words in message, message
    assert "\n" not in message and not [s for s in (ALICE, BOB, "short-token") if s in message]


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    [line] = proc.stderr.strip().splitlines()
    return line


def test_serve_and_the_app_refuse_a_bad_tokens_file_at_start_in_one_line(tmp_path: Path, redis_url: str,
                                                                         make_app: Any) -> None:
    path = tmp_path / "operators.tokens"
    env = {**CLEAN_ENV, "TRAINMEDIC_SIGNING_KEY": SIGNING_KEY, "TRAINMEDIC_OPERATOR_TOKENS_FILE": str(path),
           "TRAINMEDIC_WEBHOOK_TOKEN": "webhook-token-0123456789"}
    cases = [(f"alice {ALICE}\nbob short\n", "line 2: the token is shorter than 16 characters"),
             (f"alice {ALICE}\nbob webhook-token-0123456789\n", "the token of bob is also TRAINMEDIC_WEBHOOK_TOKEN"),
             (None, "cannot read TRAINMEDIC_OPERATOR_TOKENS_FILE")]
    for text, words in cases:
        if text is None:
            path.unlink()
        else:
            path.write_text(text)
        port = free_port()
        proc = subprocess.run([*CLI, "serve", "--redis-url", redis_url, "--no-agent", "--port", str(port),
                               "--data-dir", str(tmp_path / "data")], capture_output=True, text=True, env=env,
                              cwd=ROOT, timeout=60)
        line = one_line_error(proc)
        assert line.startswith("trainmedic: ") and words in line and str(path) in line, line
        assert "short" not in line.replace("shorter", "") and "webhook-token-0123456789" not in line
        assert not (tmp_path / "data").exists()  # refused before anything was made or started
    # The read token may not be another token either.
    proc = subprocess.run([*CLI, "serve", "--redis-url", redis_url, "--no-agent", "--port", str(free_port())],
                          capture_output=True, text=True, cwd=ROOT, timeout=60,
                          env={**env, "TRAINMEDIC_OPERATOR_TOKENS_FILE": "", "TRAINMEDIC_OPERATOR_TOKEN": OPERATOR,
                               "TRAINMEDIC_READ_TOKEN": OPERATOR})
    assert "TRAINMEDIC_READ_TOKEN is also TRAINMEDIC_OPERATOR_TOKEN" in one_line_error(proc)
    # The app (what each gunicorn worker builds) refuses the same way, with the same sentence.
    path.write_text("alice\n")
    with pytest.raises(SettingsError, match=r"line 1: a line is `NAME TOKEN`"):
        make_app(operator_tokens_file=str(path))


def test_serve_says_how_to_add_a_person_and_its_command_works(tmp_path: Path, redis_url: str,
                                                              r: redis.Redis) -> None:
    path = tmp_path / "operators.tokens"
    path.write_text(f"alice {ALICE}\n")
    path.chmod(0o600)
    port = free_port()
    proc = subprocess.Popen([*CLI, "serve", "--redis-url", redis_url, "--no-agent", "--port", str(port),
                             "--workers", "1", "--data-dir", str(tmp_path / "data")], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
                            env={**CLEAN_ENV, "TRAINMEDIC_SIGNING_KEY": SIGNING_KEY, "TRAINMEDIC_OPERATOR_TOKEN":
                                 OPERATOR, "TRAINMEDIC_OPERATOR_TOKENS_FILE": str(path)})
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        while not any("max_alerts: 0" in line for line in lines):  # the banner's last line
            line = proc.stdout.readline()
            assert line, "".join(lines)
            lines.append(line.rstrip("\n"))
    finally:
        proc.terminate()
        proc.wait(30)
    [at] = [i for i, line in enumerate(lines) if "a token of their own" in line]
    assert lines[at] == ("# Add a person with a token of their own (recorded as operator:NAME; 1 named so far), "
                         "then restart:")
    command = lines[at + 1]
    assert str(path) in command and "alice" in command
    assert lines[at + 2].startswith("# Reads (history, pages) are open") and "TRAINMEDIC_READ_TOKEN" in lines[at + 2]
    assert not [s for s in (ALICE, OPERATOR) if s in "\n".join(lines)]  # tokens it was given are never printed
    # The printed command, as a person would paste it (with their own name), adds a good line to the file.
    subprocess.run(["bash", "-c", command.replace("alice", "carol")], check=True, timeout=30)
    added = People.from_settings(ServiceSettings(operator_tokens_file=str(path), signing_key=SIGNING_KEY))
    assert added.names == ["operator:alice", "operator:carol"]
    carol = path.read_text().splitlines()[1].split()[1]
    assert added.operator(carol) == "operator:carol" and len(carol) >= 32
    # Without a tokens file yet, the lines name one in the data dir, and the command makes it for its owner only.
    data = tmp_path / "data"
    first, command = add_person_lines(ServiceSettings(), data, 0).splitlines()
    made = data / "operators.tokens"
    assert f"then set TRAINMEDIC_OPERATOR_TOKENS_FILE={made} and restart" in first
    subprocess.run(["bash", "-c", command], check=True, timeout=30)
    assert stat.S_IMODE(made.stat().st_mode) == 0o600
    assert People.from_settings(ServiceSettings(operator_tokens_file=str(made))).names == ["operator:alice"]


def test_the_webhook_token_still_posts_webhooks_when_reads_need_a_token(make_app: Any, tokens_file: Path) -> None:
    http = make_app(read_token=READ, operator_tokens_file=str(tokens_file)).test_client()
    resp = http.post("/webhook", data=json.dumps(load_fixture("firing_single.json")),
                     content_type="application/json", headers=AUTH)
    assert resp.status_code == 200  # the webhook token still posts webhooks; only reads changed
    assert http.get("/history", headers=OP_AUTH).get_json()["items"]
