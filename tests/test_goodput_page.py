"""The job's page in a real headless Chromium: its time as a bar by kind, its goodput, its incidents linking to
their records, at a desktop's and a half screen's width; every job target on the history page links to it."""
from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from playwright.sync_api import Browser, Page

from trainmedic.client import RemediationClient
from trainmedic.client.wire import keys
from trainmedic.service import goodput, history

from tests.support.browser import Server, shot
from tests.support.jobs import send, wait_record
from tests.test_goodput import Proc
from tests.test_ui_layout import MEASURE

JOB = "llama-ft-01"


@pytest.fixture
def site(r: redis.Redis, make_app: Any, redis_url: str) -> Iterator[tuple[Server, dict[str, str]]]:
    """An hour of a job (steps, a stall, a process killed, down time, a resume from an older step) folded as its
    heartbeats would be, then two real remediations acknowledged by a real client: one the job recovered from."""
    app = make_app()
    now = time.time()
    t0 = now - 3600

    def fold(t: float, beat: dict | None) -> None:
        goodput.fold(r, [(keys.Target("job", JOB), beat)], t)

    a = Proc(JOB, t0)
    for minute in range(1, 21):  # 20 minutes of steps, a 5-minute stall, 10 more minutes
        a.steps(minute * 600, 60)
        fold(t0 + minute * 60, a.beat(t0 + minute * 60))
    a.steps(12000, 300, "stall")
    fold(t0 + 1500, a.beat(t0 + 1500))
    a.steps(18000, 600)
    fold(t0 + 2100, a.beat(t0 + 2100))
    fold(t0 + 2140, None)  # killed: no close(), its heartbeat expired
    b = Proc(JOB, t0 + 2400)  # five minutes later, resumed from step 15000
    b.first = b.high = b.step = 15000
    fold(t0 + 2401, b.beat(t0 + 2400))
    for minute in range(1, 20):
        b.steps(15000 + minute * 600, 60)
        fold(t0 + 2400 + minute * 60, b.beat(t0 + 2400 + minute * 60))
    rc = RemediationClient(job=JOB, redis_url=redis_url, heartbeat_interval=0.2)
    rc.register("rollback_checkpoint", lambda params: {"restored_step": b.step})
    rc.register("empty_cache", lambda params: {"freed_bytes": 0})
    ids = {}
    for name, action in (("recovered", "rollback_checkpoint"), ("open", "empty_cache")):
        rid = ids[name] = send(r, JOB, action)
        wait_record(r, rid, tick=lambda: rc.poll(step=0))
        history.catch_up(r)
        t = time.time()
        fold(t, b.beat(t))  # the fold that notes the incident's highest step
        if name == "recovered":
            b.steps(b.step + 600, 1)
            fold(t + 1, b.beat(t + 1))
    rc.close()
    server = Server(app)
    yield server, ids
    server.stop()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    ctx = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = ctx.new_page()
    yield pg
    ctx.close()


def test_the_job_page_shows_its_time_by_kind_its_goodput_and_incidents(site: tuple[Server, dict[str, str]],
                                                                      page: Page, r: redis.Redis) -> None:
    server, ids = site
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    for width in (1280, 800):
        page.set_viewport_size({"width": width, "height": 900})
        job = page.request.get(f"{server.url}/jobs/{JOB}").json()
        page.goto(f"{server.url}/targets/job/{JOB}")
        section = page.locator("#goodput")
        assert f"{100 * job['goodput']:.1f}%" in section.locator(".gp-value").inner_text()
        # The bar: one rectangle per kind, as wide as its share of the wall-clock time.
        widths = {kind: float(page.locator(f"#goodput svg rect.gp-{kind}").get_attribute("width") or 0)
                  for kind in ("productive", "stall", "recompute", "down")}
        shares = {"productive": job["productive_s"], **job["lost_s"]}
        for kind, width_units in widths.items():
            assert width_units == pytest.approx(1000 * shares[kind] / job["wall_s"], abs=0.5), kind
        assert all(widths.values())  # this hour had each of them
        legend = section.locator(".gp-legend").inner_text()
        assert all(word in legend for word in ("productive", "stalled", "recomputed", "down"))
        # The incidents, newest first, each linking to its record's page.
        rows = section.locator("table.gp-incidents tbody tr")
        assert rows.count() == 2
        assert rows.nth(0).locator("a").get_attribute("href") == f"/records/{ids['open']}"
        assert rows.nth(1).locator("a").get_attribute("href") == f"/records/{ids['recovered']}"
        assert "not yet" in rows.nth(0).inner_text() and "not yet" not in rows.nth(1).inner_text()
        assert page.evaluate(MEASURE) == []
        shot(page, f"goodput-job-{width}.png")
    assert not errors, errors  # among them, any script or style the CSP refused
    html = page.request.get(f"{server.url}/targets/job/{JOB}").text()  # as served, before any script ran
    assert not re.search(r"<script(?![^>]*\ssrc=)", html) and " style=" not in html


def test_every_job_target_on_the_history_page_links_to_its_page(site: tuple[Server, dict[str, str]],
                                                                  page: Page) -> None:
    server, ids = site
    page.goto(server.url + "/")
    links = page.locator("details.rec .c-target a")
    assert links.count() == 2
    assert {links.nth(i).get_attribute("href") for i in range(2)} == {f"/targets/job/{JOB}"}
    links.first.click()
    page.wait_for_url(f"**/targets/job/{JOB}")
    assert page.locator("#goodput .gp-value").is_visible()


def test_a_job_with_no_figures_says_so(r: redis.Redis, make_app: Any, page: Page) -> None:
    server = Server(make_app())
    try:
        page.goto(f"{server.url}/targets/job/nobody")
        assert "No figures yet" in page.locator("#goodput").inner_text()
        page.goto(f"{server.url}/targets/node/gpu-1")
        assert page.locator("#goodput").count() == 0  # nodes have no goodput
    finally:
        server.stop()
