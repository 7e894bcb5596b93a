"""Hostile input on every endpoint that GET /openapi.json lists, through real gunicorn with 2 workers.

Odd Unicode digits, overflowing dates, NaN and infinities, huge numbers, duplicate keys, 10,000 labels, deep
nesting, huge strings and control characters, in bodies, query strings and paths. Each answer is the README's
status (never a 5xx; 503 only while Redis is down) with a one-sentence {"error"} body (pages: HTML saying why),
and nothing is ever dispatched: no mailbox entry appears.
"""
from __future__ import annotations

import copy
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Iterator
from urllib.parse import quote, urlencode

import pytest
import redis
import requests

from trainmedic.client.wire import keys
from trainmedic.service.embedded_redis import EmbeddedRedis

from tests.conftest import AUTH, OP_AUTH, ROOT, Gunicorn, load_fixture

HELD = """\
playbooks:
  - name: held-for-approval
    matchers: ['alertname="HeldForApproval"']
    target: job
    approval: true
    actions:
      - scale_lr: {factor: 0.5}
"""
JSON = {"Content-Type": "application/json"}
ODD_DIGITS = ["²", "٣", "１０", "𝟓", "߁", "Ⅻ"]
BAD_DATES = ["9999-12-31T23:59:59-23:59", "0001-01-01T00:00:00+23:59", "99999-01-01T00:00:00Z",
             "2026-02-30T00:00:00Z", "2026-01-01T24:00:00Z", "2026-01-01T00:00:00+24:00", "²⁰²⁶-01-01T00:00:00Z"]
NON_FINITE = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", str(10**400), "-" + str(10**400)]
SHORT = {str(10**400): "10**400", "-" + str(10**400): "-10**400"}  # names of the literals in test ids
CONTROL = ["\x00", "a\r\nX-Injected: 1", "\x1b[31mred", "\u202eevil", "\ufeffbom", "\x7f", "tab\there"]
HUGE = "x" * 900_000  # under the 1 MiB body limit
OVER_LIMIT = "x" * (1 << 20)
DEEP = 100_000


def alert(fingerprint: str = "abcdef0123456789", **labels: str) -> dict:
    a = copy.deepcopy(load_fixture("firing_single.json")["alerts"][0])
    a["labels"] = {"alertname": "TrainingLossSpike", "severity": "critical", "job_name": "llama-ft-01", **labels}
    a["fingerprint"] = fingerprint
    return a


def group(*alerts: dict, **extra: Any) -> dict:
    body = copy.deepcopy(load_fixture("firing_single.json"))
    body["alerts"] = list(alerts)
    body.update(extra)
    return body


def dumps(value: Any) -> str:
    return json.dumps(value)


def put(body: Any, literal: str) -> str:
    """The body's JSON with the string "@@" replaced by a raw literal (NaN, 1e999, a duplicate key ...)."""
    return dumps(body).replace('"@@"', literal)


@dataclass(frozen=True)
class Case:
    name: str
    method: str
    path: str  # "{held}" becomes the id of a record held for approval; already percent-encoded
    expect: int
    body: str | bytes | None = None
    words: str = ""  # in the error sentence (or the page)
    content_type: str | None = "application/json"

    def __str__(self) -> str:
        return self.name


def q(**params: str) -> str:
    return "?" + urlencode(params, quote_via=quote)


def seg(value: str) -> str:
    return quote(value, safe="")


CASES: list[Case] = []


def case(name: str, method: str, path: str, expect: int, body: Any = None, words: str = "", **kw: Any) -> None:
    text = body if body is None or isinstance(body, (str, bytes)) else dumps(body)
    CASES.append(Case(name, method, path, expect, text, words, **kw))


# -- POST /webhook (the webhook token)
for lit in NON_FINITE:
    n = SHORT.get(lit, lit)
    case(f"webhook: {n} as a number", "POST", "/webhook", 400, put(group(alert(), truncatedAlerts="@@"), lit),
         "finite number")
case("webhook: duplicate keys at the top", "POST", "/webhook", 400,
     dumps(group(alert()))[:-1] + ', "alerts": []}', "appears twice")
case("webhook: duplicate label keys", "POST", "/webhook", 400,
     put(group(alert(job_name="@@")), '"a", "job_name": "b"'), "appears twice")
for d in BAD_DATES:
    case(f"webhook: startsAt {d}", "POST", "/webhook", 400, group(alert(**{}) | {"startsAt": d}), "startsAt")
for digit in ODD_DIGITS:
    case(f"webhook: version {digit}", "POST", "/webhook", 400, group(alert(), version=digit), "version")
    case(f"webhook: job_name {digit} is a bad label", "POST", "/webhook", 200, group(alert(job_name=digit)))
for c in CONTROL:
    case(f"webhook: job_name {c!r} is a bad label", "POST", "/webhook", 200, group(alert(job_name=c)))
    case(f"webhook: fingerprint {c!r}", "POST", "/webhook", 400, group(alert(fingerprint=c)), "fingerprint")
case("webhook: 10,000 labels with a hostile target label", "POST", "/webhook", 200,
     group(alert(job_name="../../etc/passwd", **{f"label_{i}": "v" for i in range(10_000)})))
case("webhook: 10,000 labels that match no playbook", "POST", "/webhook", 200,
     group(alert(alertname="NoPlaybookMatches", **{f"label_{i}": "v" for i in range(10_000)})))
case("webhook: 10,000 alerts", "POST", "/webhook", 400,
     group(*[{"status": "firing", "labels": {"alertname": "X"}, "startsAt": "2026-01-01T00:00:00Z"}] * 10_000),
     "at most")
case("webhook: 900 KB job_name is a bad label", "POST", "/webhook", 200, group(alert(job_name=HUGE)))
case("webhook: 900 KB annotation on an alert no playbook takes", "POST", "/webhook", 200,
     group(alert(alertname="NoPlaybookMatches") | {"annotations": {"summary": HUGE}}))
case("webhook: a body over 1 MiB", "POST", "/webhook", 413, group(alert(job_name=OVER_LIMIT)), "larger than")
case("webhook: nested 100,000 deep", "POST", "/webhook", 400, "[" * DEEP + "]" * DEEP, "nested too deeply")
case("webhook: nested in a label", "POST", "/webhook", 400,
     put(group(alert(job_name="@@")), '{"a":' * 5000 + "1" + "}" * 5000), "nested too deeply")
case("webhook: an unpaired surrogate", "POST", "/webhook", 400, put(group(alert(job_name="@@")), '"\\ud800"'),
     "surrogate")
case("webhook: invalid UTF-8", "POST", "/webhook", 400, b'{"alerts": ["\xed\xa0\x80"]}', "UTF-8")
case("webhook: a resolve with an overflowing endsAt for an episode never seen", "POST", "/webhook", 200,
     group(alert() | {"status": "resolved", "endsAt": "9999-12-31T23:59:59-23:59"}, status="resolved"))
case("webhook: form content type", "POST", "/webhook", 415, "alerts=1", "application/json",
     content_type="application/x-www-form-urlencoded")

# -- POST /remediations (manual trigger, the operator token)
TRIGGER = {"playbook": "loss-spike", "labels": {"job_name": "@@"}}
for lit in NON_FINITE:
    case(f"trigger: {SHORT.get(lit, lit)} as a label", "POST", "/remediations", 400, put(TRIGGER, lit), "finite number")
case("trigger: duplicate keys", "POST", "/remediations", 400, '{"playbook": "loss-spike", "playbook": "x"}',
     "appears twice")
for v in [*ODD_DIGITS, *CONTROL, HUGE[:5000]]:
    case(f"trigger: job_name {v[:12]!r} is a bad label", "POST", "/remediations", 201,
         dumps(TRIGGER).replace('"@@"', json.dumps(v)))
    case(f"trigger: playbook {v[:12]!r} does not exist", "POST", "/remediations", 404, {"playbook": v},
         "no playbook named")
case("trigger: 10,000 labels with a hostile target label", "POST", "/remediations", 201,
     {"playbook": "loss-spike", "labels": {"job_name": "a b", **{f"label_{i}": "v" for i in range(10_000)}}})
case("trigger: labels of numbers", "POST", "/remediations", 400, {"playbook": "loss-spike", "labels": {"a": 1}},
     "labels")
case("trigger: nested 100,000 deep", "POST", "/remediations", 400, "{" * 1 + '"a":' + "[" * DEEP + "]" * DEEP + "}",
     "nested too deeply")
case("trigger: a body over 1 MiB", "POST", "/remediations", 413, {"playbook": OVER_LIMIT}, "larger than")
case("trigger: an unpaired surrogate", "POST", "/remediations", 400, put(TRIGGER, '"\\udfff"'), "surrogate")

# -- POST /commands (the operator token)
def command(**over: Any) -> dict:
    return {"target": "job:llama-ft-01", "action": "set_lr", "params": {"lr": 0.1}, **over}


for lit in NON_FINITE:
    n = SHORT.get(lit, lit)
    case(f"command: lr {n}", "POST", "/commands", 400, put(command(params={"lr": "@@"}), lit), "finite number")
    case(f"command: expire_after {n}", "POST", "/commands", 400, put(command(expire_after="@@"), lit),
         "finite number")
for digit in ODD_DIGITS:
    case(f"command: lr {digit}", "POST", "/commands", 400, command(params={"lr": digit}), "lr must be a number")
    case(f"command: target job:{digit}", "POST", "/commands", 400, command(target=f"job:{digit}"), "target must be")
    case(f"command: expire_after {digit}h", "POST", "/commands", 400, command(expire_after=f"{digit}h"),
         "expire_after")
for c in CONTROL:
    case(f"command: target job:{c!r}", "POST", "/commands", 400, command(target=f"job:{c}"), "target must be")
    case(f"command: action {c!r}", "POST", "/commands", 400, command(action=c), "unknown action")
case("command: an overflowing duration", "POST", "/commands", 400, command(expire_after="9" * 40 + "d"),
     "expire_after")
case("command: expire_after 10**30 seconds", "POST", "/commands", 400, command(expire_after=10**30), "expire_after")
case("command: 10,000 params", "POST", "/commands", 400, command(params={f"p{i}": 1 for i in range(10_000)}),
     "has no parameter")
case("command: duplicate params", "POST", "/commands", 400, put(command(params="@@"), '{"lr": 0.1, "lr": 9}'),
     "appears twice")
case("command: nested params", "POST", "/commands", 400, put(command(params="@@"), "[" * DEEP + "]" * DEEP),
     "nested too deeply")
case("command: a 900 KB target", "POST", "/commands", 400, command(target="job:" + HUGE), "target must be")
case("command: a body over 1 MiB", "POST", "/commands", 413, command(action=OVER_LIMIT), "larger than")
case("command: no body", "POST", "/commands", 415, None, "application/json", content_type=None)

# -- GET /remediations/{id}, POST .../approve and .../reject (the operator token)
HOSTILE_IDS = [*ODD_DIGITS, *CONTROL, "x" * 3000, "NaN", "1e999", "%", "~job~", "0" * 26 + "~job~..",
               "0" * 26 + "~node~"]
for v in HOSTILE_IDS:
    case(f"record: id {v[:12]!r}", "GET", f"/remediations/{seg(v)}", 404, None, "no remediation")
    for verb in ("approve", "reject"):
        case(f"{verb}: id {v[:12]!r}", "POST", f"/remediations/{seg(v)}/{verb}", 404, {}, "no remediation")
for verb in ("approve", "reject"):
    for lit in NON_FINITE:
        case(f"{verb}: comment {SHORT.get(lit, lit)}", "POST", f"/remediations/{{held}}/{verb}", 400,
             put({"comment": "@@"}, lit), "finite number")
    case(f"{verb}: a 900 KB comment", "POST", f"/remediations/{{held}}/{verb}", 400, {"comment": HUGE},
         "at most 1000")
    case(f"{verb}: duplicate keys", "POST", f"/remediations/{{held}}/{verb}", 400, '{"comment": "a", "comment": "b"}',
         "appears twice")
    case(f"{verb}: a comment of numbers", "POST", f"/remediations/{{held}}/{verb}", 400, {"comment": 5}, "comment")
    case(f"{verb}: nested", "POST", f"/remediations/{{held}}/{verb}", 400,
         '{"comment": ' + "[" * DEEP + "]" * DEEP + "}", "nested too deeply")
    case(f"{verb}: unknown fields", "POST", f"/remediations/{{held}}/{verb}", 400,
         {f"k{i}": i for i in range(10_000)}, "unknown field")
    case(f"{verb}: an unpaired surrogate", "POST", f"/remediations/{{held}}/{verb}", 400,
         put({"comment": "@@"}, '"\\ud83d"'), "surrogate")
    case(f"{verb}: text/plain", "POST", f"/remediations/{{held}}/{verb}", 415, "{}", "application/json",
         content_type="text/plain")
# Control characters in a comment are text: kept as given (escaped wherever shown); reject, so nothing dispatches.
case("reject: a comment of control characters is text", "POST", "/remediations/{held}/reject", 200,
     {"comment": "".join(CONTROL)})

# -- GET /history and GET / (the page answers HTML)
QUERIES: list[tuple[str, str, int]] = []
for digit in ODD_DIGITS:
    QUERIES += [("limit", digit, 400), ("status", digit, 400), ("outcome", digit, 400), ("before", digit, 400)]
for lit in NON_FINITE:
    QUERIES += [("limit", lit, 400)]
for c in CONTROL:
    QUERIES += [("limit", c, 400), ("status", c, 400), ("before", c, 400), ("alertname", c, 200), ("target", c, 200),
                ("playbook", c, 200), (c, "1", 400)]
for d in BAD_DATES:
    QUERIES += [("before", d, 400)]
QUERIES += [("limit", "0", 400), ("limit", "501", 400), ("limit", "9" * 1000, 400), ("limit", "-1", 400),
            ("alertname", "x" * 3000, 400), ("target", "x" * 257, 400), ("target", "x" * 256, 200)]
for name, value, status in QUERIES:
    shown = SHORT.get(value, value[:12])
    case(f"history: {name[:10]!r}={shown!r}", "GET", "/history" + q(**{name: value}), status)
    case(f"page: {name[:10]!r}={shown!r}", "GET", "/" + q(**{name: value}), status)
case("history: 300 unknown parameters", "GET", "/history?" + "&".join(f"p{i}=1" for i in range(300)), 400,
     None, "unknown query parameter")
# gunicorn itself refuses a request line over 4094 bytes, before the app: its own HTML, as the OpenAPI says.
case("history: a query over 4094 bytes", "GET", "/history" + q(alertname="x" * 5000), 414)

# -- GET /targets/{kind}/{name} (HTML)
for v in [*ODD_DIGITS, *CONTROL, "x" * 129, "..", "."]:
    case(f"target page: job/{v[:12]!r}", "GET", f"/targets/job/{seg(v).replace('.', '%2E')}", 404, None,
         "There is no target")
case("target page: a name with a slash is no page", "GET", "/targets/job/a%2Fb", 404, None, "no such endpoint")
for v in [*ODD_DIGITS, "\x00", "jobs"]:
    case(f"target page: kind {v!r}", "GET", f"/targets/{seg(v)}/x", 404, None, "There is no target")

# -- GET /jobs and GET /jobs/{name}: a bad query is one sentence; a name that is no job's, a 404
JOB_QUERIES: list[tuple[str, str, int]] = [("limit", "abc", 400), ("limit", "0", 400), ("limit", "1001", 400),
                                           ("limit", "9" * 1000, 400), ("live", "maybe", 400), ("live", "true", 200),
                                           ("before", "x" * 300, 400), ("before", "l:" + "x" * 129, 400)]
for digit in ODD_DIGITS:
    JOB_QUERIES += [("limit", digit, 400), ("before", digit, 400)]
for c in CONTROL:
    JOB_QUERIES += [("limit", c, 400), ("live", c, 400), ("before", c, 400), (c, "1", 400)]
for lit in NON_FINITE:
    JOB_QUERIES += [("limit", lit, 400)]
for name, value, status in JOB_QUERIES:
    case(f"jobs: {name[:10]!r}={SHORT.get(value, value[:12])!r}", "GET", "/jobs" + q(**{name: value}), status,
         None, "" if status == 200 else "")
for v in [*ODD_DIGITS, *CONTROL, "x" * 129, "..", ".", "x" * 3000]:
    case(f"job: {v[:12]!r}", "GET", f"/jobs/{seg(v).replace('.', '%2E')}", 404, None, "no job named")

# -- GET /records/{id} (HTML): any id that is not a record's is a page saying so
for v in [*ODD_DIGITS, *CONTROL, "x" * 200, "..", "01ARZ3NDEKTSV4RRFFQ69G5FAV~job~x"]:
    case(f"record page: {v[:12]!r}", "GET", f"/records/{seg(v).replace('.', '%2E')}", 404, None,
         "There is no remediation")

# -- endpoints without parameters: hostile query strings are ignored
for path in ("/targets", "/playbooks", "/healthz", "/readyz", "/metrics", "/openapi.json"):
    for name, value in [("limit", "²"), ("x", "\x00\r\n"), ("NaN", "1e999"), ("x" * 1000, "y" * 2000)]:
        case(f"{path}: ?{name[:10]!r}={value[:10]!r} is ignored", "GET", path + q(**{name: value}), 200)


# -- the service

@dataclass
class Service:
    g: Gunicorn
    r: redis.Redis
    held: list[str]

    def new_held(self) -> str:
        """A record held for approval (made through the webhook; nothing dispatched)."""
        fp = f"{len(self.held) + 1:016x}"
        body = group(alert(fingerprint=fp, alertname="HeldForApproval"))
        resp = requests.post(self.g.url + "/webhook", json=body, headers=AUTH, timeout=10)
        assert resp.status_code == 200, resp.text
        [rec] = resp.json()["remediations"]
        assert rec["status"] == "pending_approval", rec
        self.held.append(rec["id"])
        return str(rec["id"])


def start(redis_url: str, tmp: Path) -> Gunicorn:
    books = tmp / "playbooks"
    books.mkdir(exist_ok=True)
    shutil.copy(ROOT / "playbooks" / "default.yaml", books / "default.yaml")
    (books / "held.yaml").write_text(HELD)
    return Gunicorn({"TRAINMEDIC_REDIS_URL": redis_url, "TRAINMEDIC_PLAYBOOKS": str(books)}, 2, tmp)


@pytest.fixture(scope="module")
def service(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    r.flushall()
    g = start(redis_server.url, tmp_path_factory.mktemp("hostile"))
    try:
        yield Service(g, r, [])
    finally:
        g.stop()
        r.flushall()
        r.close()


def send(url: str, c: Case, held: str = "") -> requests.Response:
    headers: dict[str, str] = {}
    if c.method == "POST":
        headers.update(AUTH if c.path == "/webhook" else OP_AUTH)
        if c.content_type:
            headers["Content-Type"] = c.content_type
    data = c.body.encode() if isinstance(c.body, str) else c.body
    req = requests.Request(c.method, url + c.path.replace("{held}", held), data=data, headers=headers).prepare()
    with requests.Session() as s:
        return s.send(req, timeout=60)


def sentence(resp: requests.Response) -> str:
    """The one human sentence of a refusal: {"error"} for the API, the page's own words for HTML pages."""
    if resp.headers["Content-Type"].startswith("text/html"):
        text = re.sub(r"<[^>]+>", " ", resp.text)
        return " ".join(text.split())
    body = json.loads(resp.text, parse_constant=lambda name: pytest.fail(f"{name} in an answer"))
    assert isinstance(body, dict) and list(body) == ["error"], body
    error = body["error"]
    assert isinstance(error, str) and error.strip(), body
    # Echoed input is escaped: no raw control character (log or terminal injection) reaches the sentence.
    assert not re.search(r"[\x00-\x1f\x7f\u202a-\u202e\u2066-\u2069]", error), error
    return error


def dispatched(r: redis.Redis) -> list[str]:
    """Mailbox streams in Redis, and records that went out to one: what 'nothing dispatched' rules out."""
    boxes = list(r.scan_iter(match=keys.PREFIX + "*:mailbox", count=1000))
    sent = [k for k in r.scan_iter(match=keys.PREFIX + "*:rec:*", count=1000) if r.hget(k, "dispatched_ms")]
    return boxes + sent


@pytest.mark.parametrize("c", CASES, ids=str)
def test_hostile_input_gets_the_contracts_answer_in_one_sentence_and_dispatches_nothing(service: Service,
                                                                                       c: Case) -> None:
    held = service.new_held() if "{held}" in c.path else ""
    resp = send(service.g.url, c, held)
    assert resp.status_code == c.expect, (resp.status_code, resp.text[:300])
    if resp.status_code == 414:
        assert resp.headers["Content-Type"].startswith("text/html")  # gunicorn's own answer
    elif resp.status_code >= 400:
        said = sentence(resp)
        assert c.words in said, said[:300]
    elif resp.headers["Content-Type"].startswith("application/json"):
        body = json.loads(resp.text, parse_constant=lambda name: pytest.fail(f"{name} in an answer"))
        for rec in body.get("remediations", []) if c.path == "/webhook" else []:
            assert (rec["status"], rec["reason"]) == ("skipped", "bad_label"), rec
        if c.path == "/remediations":
            assert (body["status"], body["reason"]) == ("skipped", "bad_label"), body
    assert dispatched(service.r) == []
    if held and c.expect >= 400:
        rec = requests.get(f"{service.g.url}/remediations/{held}", timeout=10).json()
        assert rec["status"] == "pending_approval"  # a refused approve or reject changed nothing


def test_every_endpoint_of_the_openapi_document_is_in_the_table(service: Service) -> None:
    doc = requests.get(service.g.url + "/openapi.json", timeout=10).json()
    listed = {(method.upper(), path) for path, ops in doc["paths"].items() for method in ops}

    def template(c: Case) -> tuple[str, str]:
        path = c.path.split("?")[0]
        for pattern, name in ((r"^/remediations/[^/]+/(approve|reject)$", r"/remediations/{id}/\1"),
                              (r"^/remediations/[^/]+$", "/remediations/{id}"),
                              (r"^/targets/[^/]+/[^/]+$", "/targets/{kind}/{name}"),
                              (r"^/records/[^/]+$", "/records/{id}"), (r"^/jobs/[^/]+$", "/jobs/{name}")):
            if re.match(pattern, path) and path != "/remediations":
                path = re.sub(pattern, name, path)
        return c.method, path
    covered = {template(c) for c in CASES}
    assert listed <= covered, f"endpoints without hostile cases: {sorted(listed - covered)}"


def test_with_redis_down_every_case_gets_its_refusal_or_503_and_never_another_5xx(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis", appendonly=False).start()
    g = start(server.url, tmp_path)
    try:
        server.stop()
        for c in CASES:
            if "{held}" in c.path:
                continue
            resp = send(g.url, c)
            if c.path.startswith(("/healthz", "/openapi.json")):
                assert resp.status_code == 200, c
                continue
            if c.path.startswith("/readyz"):
                assert resp.status_code == 503, c
            # Refusals that need no Redis come first; anything else is 503, "try again".
            assert resp.status_code in (c.expect, 503), (c, resp.status_code, resp.text[:200])
            if resp.status_code >= 400 and resp.status_code != 414:
                sentence(resp)
    finally:
        g.stop()
        server.stop()


@pytest.mark.parametrize("heartbeat", [
    '{"kind": "job", "host": "\\ud800", "last_seen": %(now)s}',  # an unpaired surrogate: shown as "?"
    '{"kind": "job", "last_seen": 1e12}',  # sent in the year 33658
    '{"kind": "job", "last_seen": NaN}',
    '{"kind": "job", "lr": [Infinity], "last_seen": %(now)s}',
    '{"kind": "job", "last_seen": "soon"}',
    '[1, 2, 3]',
    'not json at all',
], ids=["an unpaired surrogate", "a far future", "NaN", "an infinite LR", "a word for a time", "a list", "no JSON"])
def test_what_a_trainer_writes_into_its_heartbeat_cannot_break_get_targets_or_the_pages(service: Service,
                                                                                       heartbeat: str) -> None:
    # A trainer holds Redis access to its own job's keys: it can write anything there.
    import time

    target = keys.Target("job", "sneaky")
    service.r.set(keys.heartbeat(target), heartbeat % {"now": time.time()}, px=60_000)
    service.r.zadd(keys.TARGETS, {target.label: time.time()})
    try:
        for path in ("/", "/targets/job/sneaky", "/targets"):
            resp = requests.get(service.g.url + path, timeout=10)
            assert resp.status_code == 200, (path, resp.text[:200])
        listed = json.loads(requests.get(service.g.url + "/targets", timeout=10).text,
                            parse_constant=lambda name: pytest.fail(f"{name} in GET /targets"))
        names = [t["name"] for t in listed["targets"]]
        assert names == (["sneaky"] if "%(now)s" in heartbeat and "Infinity" not in heartbeat else [])
    finally:
        service.r.delete(keys.heartbeat(target))
        service.r.zrem(keys.TARGETS, target.label)
