"""Approve and reject from the page, in a real headless Chromium: a person logs in once with their own operator
token (a form, a signed session cookie that never holds the token), then a same-origin JSON POST from the
service's own script acts as them, and the record says who decided."""
from __future__ import annotations

import threading
from http.server import HTTPServer
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import pytest
import redis
from playwright.sync_api import Browser, Page, expect

from tests.conftest import OPERATOR, post_json
from tests.support.browser import Server, StaticPage, shot
from tests.test_ui import alert

ALICE = "alice-token-" + "0123456789abcdef" * 2
PLAYBOOKS = """
playbooks:
  - name: drain-xid
    matchers: ['alertname="GPUXidError"']
    target: node
    approval: true
    actions: [{drain_node: {reason: "GPU hardware error"}}]
"""


@pytest.fixture
def held(make_app: Any, r: redis.Redis, tmp_path: Path) -> Iterator[tuple[Server, list[str]]]:
    (tmp_path / "pb.yaml").write_text(PLAYBOOKS)
    (tmp_path / "operators.tokens").write_text(f"alice {ALICE}\n")
    app = make_app(playbooks=str(tmp_path / "pb.yaml"), operator_tokens_file=str(tmp_path / "operators.tokens"),
                   UI_REFRESH_SECONDS=1)
    http = app.test_client()
    ids = []
    for i, node in enumerate(("gpu-node-07", "gpu-node-08")):
        resp = post_json(http, "/webhook", alert("GPUXidError", f"x{i}", node=node))
        [rec] = resp.get_json()["remediations"]
        assert rec["status"] == "pending_approval"
        ids.append(rec["id"])
    server = Server(app)
    yield server, ids
    server.stop()


def log_in(page: Page, token: str) -> None:
    """Follow the header's "log in" link and type the token into the form."""
    page.locator("header a.who").click()
    page.locator("#login input[name=token]").fill(token)
    page.locator("#login button").click()


def test_a_person_logs_in_once_then_approves_and_rejects_as_themselves(held: tuple[Server, list[str]],
                                                                      browser: Browser, r: redis.Redis) -> None:
    server, (first, second) = held
    ctx = browser.new_context(viewport={"width": 1360, "height": 900})
    page = ctx.new_page()
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.goto(f"{server.url}/records/{first}")
    # Not logged in: nothing is sent, and the page says how to log in.
    page.locator(".decide .approve").click()
    expect(page.locator(".decide-msg")).to_contain_text("log in with your operator token first")
    assert r.hget(f"trainmedic:{{node:gpu-node-07}}:rec:{first}", "status") == "pending_approval"
    log_in(page, ALICE)
    page.wait_for_url(f"{server.url}/records/{first}")  # back where they were
    expect(page.locator("header form.who")).to_contain_text("alice")
    page.locator(".decide .comment").fill("XID 79 on GPU 3, draining")
    page.locator(".decide .approve").click()
    expect(page.locator("#record")).to_contain_text("by operator:alice at", timeout=10_000)
    expect(page.locator("#record")).to_contain_text("XID 79 on GPU 3, draining")
    shot(page, "record-approved.png")
    # The login holds for the next decision, with no question asked.
    page.goto(f"{server.url}/records/{second}")
    page.locator(".decide .reject").click()
    expect(page.locator("#record")).to_contain_text("by operator:alice at", timeout=10_000)
    assert r.hget(f"trainmedic:{{node:gpu-node-08}}:rec:{second}", "rejected_by") == "operator:alice"
    assert dialogs == []
    # The browser keeps a session cookie the page's script cannot read, holding no token; no storage holds one.
    [cookie] = ctx.cookies()
    assert cookie["name"] == "trainmedic_session" and cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert cookie["expires"] == -1 and ALICE not in cookie["value"]
    assert "trainmedic_session" not in page.evaluate("document.cookie")
    stored = page.evaluate("JSON.stringify([Object.assign({}, sessionStorage), Object.assign({}, localStorage)])")
    assert ALICE not in stored and OPERATOR not in stored
    # Logging out clears it: the header offers "log in" again.
    page.locator("header form.who button").click()
    expect(page.locator("header a.who")).to_have_text("log in")
    assert ctx.cookies() == []
    ctx.close()


@pytest.mark.parametrize("reads", ["open", "closed"])
def test_a_link_from_another_site_lands_on_the_record_still_logged_in_or_at_the_login_form_at_once(
        held: tuple[Server, list[str]], reads: str, make_app: Any, browser: Browser, tmp_path: Path) -> None:
    server, (first, _) = held
    if reads == "closed":  # the same service, with reads needing a token
        server = Server(make_app(playbooks=str(tmp_path / "pb.yaml"), read_token="read-token-" + "7" * 24,
                                 operator_tokens_file=str(tmp_path / "operators.tokens"), UI_REFRESH_SECONDS=1))
    # The service as localhost, the chat as 127.0.0.1: two sites (two ports of one host would be one site).
    url = server.url.replace("127.0.0.1", "localhost")
    ctx = browser.new_context()
    page = ctx.new_page()
    page.goto(f"{url}/records/{first}")
    if reads == "closed":
        page.locator("#login input[name=token]").fill(ALICE)
        page.locator("#login button").click()
    else:
        log_in(page, ALICE)
    expect(page.locator("header form.who")).to_contain_text("alice")
    [before] = ctx.cookies()
    # A chat message's link: another site, so the SameSite=Strict cookie is left out of that navigation.
    chat = HTTPServer(("127.0.0.1", 0), type("Chat", (StaticPage,), {"html": (
        f'<!doctype html><a id="link" href="{url}/records/{first}">the held drain</a>').encode()}))
    threading.Thread(target=chat.serve_forever, daemon=True).start()
    try:
        page.goto(f"http://127.0.0.1:{chat.server_port}/")
        page.locator("#link").click()
        page.wait_for_url(f"{url}/records/{first}", timeout=10_000)
        expect(page.locator("header form.who")).to_contain_text("alice")
        expect(page.locator(".decide .approve")).to_be_visible()
        # The login it arrived without was kept, not replaced.
        assert [c for c in ctx.cookies() if c["name"] == "trainmedic_session"] == [before]
        # Someone not logged in gets the login form at once (reads closed), or the page (reads open): one
        # navigation, no page in between; logging in there lands on the record.
        stranger = browser.new_context()
        fresh = stranger.new_page()
        fresh.goto(f"http://127.0.0.1:{chat.server_port}/")
        loads: list[str] = []
        fresh.on("load", lambda: loads.append(fresh.url))
        fresh.locator("#link").click()
        if reads == "closed":
            fresh.wait_for_url(f"{url}/login?next=/records/{first}")
            expect(fresh.locator("#login input[name=token]")).to_be_visible()
            fresh.locator("#login input[name=token]").fill(ALICE)
            fresh.locator("#login button").click()
        else:
            fresh.wait_for_url(f"{url}/records/{first}")
            log_in(fresh, ALICE)
        fresh.wait_for_url(f"{url}/records/{first}")
        expect(fresh.locator("header form.who")).to_contain_text("alice")
        assert loads[0] == (f"{url}/login?next=/records/{first}" if reads == "closed" else f"{url}/records/{first}")
        stranger.close()
    finally:
        chat.shutdown()
        chat.server_close()
        ctx.close()
        if reads == "closed":
            server.stop()


def test_a_wrong_token_logs_nobody_in_says_why_and_changes_nothing(held: tuple[Server, list[str]],
                                                                  browser: Browser, r: redis.Redis) -> None:
    server, (first, _) = held
    ctx = browser.new_context()
    page = ctx.new_page()
    page.goto(f"{server.url}/records/{first}")
    log_in(page, "not-the-token-0123456789")
    expect(page.locator("#login-error")).to_contain_text("not one of this service")
    page.goto(f"{server.url}/records/{first}")
    expect(page.locator("header a.who")).to_have_text("log in")  # still nobody
    page.locator(".decide .approve").click()
    expect(page.locator(".decide-msg")).to_contain_text("log in")
    assert r.hget(f"trainmedic:{{node:gpu-node-07}}:rec:{first}", "status") == "pending_approval"
    # Nothing inline: the buttons and the form work from the service's own script under the page's CSP.
    for path in (f"/records/{first}", "/login"):
        resp = page.request.get(server.url + path)
        assert "script-src 'self'" in resp.headers["content-security-policy"] and "onclick" not in resp.text()
        assert "<script>" not in resp.text()
    ctx.close()


def test_the_index_shows_the_effectiveness_strip_and_filters_by_outcome(held: tuple[Server, list[str]],
                                                                        browser: Browser) -> None:
    server, _ = held
    page = browser.new_page()
    page.goto(server.url + "/?outcome=effective")
    expect(page.locator("#effectiveness")).to_contain_text("drain-xid")
    expect(page.locator("#effectiveness")).to_contain_text("no outcomes yet")
    expect(page.locator("select[name=outcome]")).to_have_value("effective")
    expect(page.locator("details.rec")).to_have_count(0)
    page.close()
