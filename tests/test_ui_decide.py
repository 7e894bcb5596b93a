"""Approve and reject from the page, in a real headless Chromium: the operator token pasted once and kept in
sessionStorage, a same-origin JSON POST from the service's own script, who decided shown on the record."""
from __future__ import annotations

from pathlib import Path
from typing import Any
from collections.abc import Iterator

import pytest
import redis
from playwright.sync_api import Browser, Page, expect

from tests.conftest import OPERATOR, post_json
from tests.support.browser import Server, shot
from tests.test_ui import alert

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
    app = make_app(playbooks=str(tmp_path / "pb.yaml"), UI_REFRESH_SECONDS=1)
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


def answering(page: Page, token: str, prompts: list[str]) -> None:
    """Paste `token` into every prompt the page opens, counting them."""
    page.on("dialog", lambda d: (prompts.append(d.message), d.accept(token)))


def test_a_person_approves_and_rejects_from_the_record_page(held: tuple[Server, list[str]], browser: Browser) -> None:
    server, (first, second) = held
    ctx = browser.new_context(viewport={"width": 1360, "height": 900})
    page = ctx.new_page()
    prompts: list[str] = []
    answering(page, OPERATOR, prompts)
    page.goto(f"{server.url}/records/{first}")
    page.locator(".decide .comment").fill("XID 79 on GPU 3, draining")
    page.locator(".decide .approve").click()
    expect(page.locator("#record")).to_contain_text("by operator at", timeout=10_000)
    expect(page.locator("#record")).to_contain_text("XID 79 on GPU 3, draining")
    assert len(prompts) == 1 and "operator token" in prompts[0]
    shot(page, "record-approved.png")
    # The token is kept for the tab: the next decision does not ask again.
    page.goto(f"{server.url}/records/{second}")
    page.locator(".decide .reject").click()
    expect(page.locator("#record")).to_contain_text("rejected", timeout=10_000)
    assert len(prompts) == 1
    ctx.close()


def test_a_wrong_token_changes_nothing_says_why_and_is_forgotten(held: tuple[Server, list[str]],
                                                                 browser: Browser, r: redis.Redis) -> None:
    server, (first, _) = held
    ctx = browser.new_context()
    page = ctx.new_page()
    prompts: list[str] = []
    answering(page, "not-the-token", prompts)
    page.goto(f"{server.url}/records/{first}")
    page.locator(".decide .approve").click()
    expect(page.locator(".decide-msg")).to_have_text("Not done: the bearer token is wrong", timeout=10_000)
    assert page.evaluate("sessionStorage.getItem('trainmedic-operator-token')") is None
    assert r.hget(f"trainmedic:{{node:gpu-node-07}}:rec:{first}", "status") == "pending_approval"
    # Nothing inline: the buttons work from the service's own script under the page's CSP.
    resp = page.request.get(f"{server.url}/records/{first}")
    assert "script-src 'self'" in resp.headers["content-security-policy"] and "onclick" not in resp.text()
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
