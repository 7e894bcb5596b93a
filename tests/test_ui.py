"""The history page at `/`, driven in a real headless Chromium (Debian's) through Playwright."""
from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import pytest
import redis
import torch
from playwright.sync_api import Browser, Page, expect

from trainmedic.client import RemediationClient
from trainmedic.client.wire import keys

from tests.conftest import load_fixture, post_json
from tests.support.browser import Server, shot

PLAYBOOKS = """
playbooks:
  - name: loss-spike
    matchers: ['alertname="TrainingLossSpike"']
    target: job
    actions:
      - rollback_checkpoint: {}
      - scale_lr: {factor: 0.5, min_lr: 1.0e-7}
  - name: gpu-memory-high
    matchers: ['alertname="GPUMemoryUsageHigh"']
    target: job
    actions:
      - empty_cache: {}                     # skipped without CUDA (ignored by the record's status)
      - reduce_batch_size: {factor: 0.5, min: 1}
      - save_checkpoint: {}                 # no handler here: unsupported, so partially applied
  - name: disk-space-low
    matchers: ['alertname="DiskSpaceLow"']
    target: node
    actions:
      - disk_cleanup: {keep_last: 3, older_than: 7d}
  - name: throughput-drop
    matchers: ['alertname="TrainingThroughputDrop"']
    target: job
    actions: []
"""


def alert(alertname: str, fingerprint: str, **labels: str) -> dict:
    """A one-alert Alertmanager notification."""
    body = copy.deepcopy(load_fixture("firing_single.json"))
    a = body["alerts"][0]
    a["labels"] = {"alertname": alertname, "severity": "critical", **labels}
    a["fingerprint"] = fingerprint
    return body


@pytest.fixture
def site(make_app: Any, r: redis.Redis, redis_url: str, tmp_path: Path) -> Iterator[tuple[Server, Any]]:
    """A served app with history made the real way: webhooks in, a training client acking with real torch."""
    (tmp_path / "pb.yaml").write_text(PLAYBOOKS)
    app = make_app(playbooks=str(tmp_path / "pb.yaml"), UI_REFRESH_SECONDS=1)
    http = app.test_client()
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1000, gamma=0.9)
    rc = RemediationClient(job="llama-ft-01", redis_url=redis_url, optimizer=opt, scheduler=sched,
                           heartbeat_interval=0.5)
    rc.register("rollback_checkpoint", lambda params: {"restored_step": 1200})
    rc.register("reduce_batch_size", lambda params: {"batch_size": 16})
    step = 0
    # The service decides by what the job's heartbeat lists: wait until it lists the handlers just registered.
    deadline = time.monotonic() + 10
    while not {"rollback_checkpoint", "reduce_batch_size"} <= set(
            json.loads(r.get(keys.heartbeat(keys.Target("job", "llama-ft-01"))) or "{}").get("actions", [])):
        assert time.monotonic() < deadline, "the heartbeat never listed the handlers"
        rc.poll(step=0)
        time.sleep(0.05)

    def remediate(body: dict) -> None:
        """Send an alert and train until the client has applied and acked its command."""
        nonlocal step
        resp = post_json(http, "/webhook", body)
        assert resp.status_code == 200
        [rec] = resp.get_json()["remediations"]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            step += 1
            rc.poll(step=step)
            if http.get(f"/remediations/{rec['id']}").get_json()["status"] != "dispatched":
                return
            time.sleep(0.01)
        raise AssertionError(f"{rec['id']} was not acked in 10 s")

    for i in (1, 2):  # two loss spikes, two episodes: the LR is halved twice
        remediate(alert("TrainingLossSpike", f"a{i}", job_name="llama-ft-01"))
    remediate(alert("GPUMemoryUsageHigh", "b1", job_name="llama-ft-01"))
    assert post_json(http, "/webhook", alert("DiskSpaceLow", "c1", node="gpu-node-07")).status_code == 200
    drop = alert("TrainingThroughputDrop", "d1", job_name="bert-base-02")
    assert post_json(http, "/webhook", drop).status_code == 200
    hostile = alert("TrainingThroughputDrop", "e1", job_name="../../etc/passwd")
    hostile["alerts"][0]["annotations"] = {"summary": "<script>alert('pwned')</script><img src=x onerror=alert(2)>"}
    assert post_json(http, "/webhook", hostile).status_code == 200
    server = Server(app)
    yield server, rc
    server.stop()
    rc.close()


@pytest.fixture
def dialogs() -> list[str]:
    """Messages of every alert()/confirm() the page opened (a script from alert text would open one)."""
    return []


@pytest.fixture
def page(browser: Browser, dialogs: list[str]) -> Iterator[Page]:
    ctx = browser.new_context(viewport={"width": 1360, "height": 900})
    pg = ctx.new_page()
    pg.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    yield pg
    ctx.close()


def test_the_page_lists_records_newest_first_and_filters_them(site: tuple[Server, Any], page: Page) -> None:
    server, _ = site
    page.goto(server.url + "/")
    rows = page.locator("details.rec")
    expect(rows).to_have_count(6)
    names = page.locator("details.rec > summary > span:nth-child(5)").all_inner_texts()
    assert names == ["TrainingThroughputDrop", "TrainingThroughputDrop", "DiskSpaceLow", "GPUMemoryUsageHigh",
                     "TrainingLossSpike", "TrainingLossSpike"]
    # Status by colour and word: the badge says it, and its colour is the status's own.
    applied = page.locator("details.rec > summary .badge.st-applied").first
    expect(applied).to_contain_text("applied")
    assert applied.evaluate("e => getComputedStyle(e).color") == "rgb(26, 127, 55)"
    expect(page.locator("details.rec > summary .badge.st-partially_applied")).to_contain_text("partially applied")
    expect(page.locator("#live")).to_contain_text("llama-ft-01")
    shot(page, "history.png")

    page.select_option("select[name=status]", "applied")
    page.click("form.filters button[type=submit]")
    page.wait_for_url("**status=applied**")
    expect(rows).to_have_count(2)
    assert set(page.locator("details.rec > summary .badge").all_inner_texts()) == {"applied"}
    page.select_option("select[name=status]", "")
    page.fill("input[name=alertname]", "DiskSpaceLow")
    page.click("form.filters button[type=submit]")
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text("gpu-node-07")


def test_a_record_expands_to_its_alert_actions_results_and_acks(site: tuple[Server, Any], page: Page) -> None:
    server, rc = site
    page.goto(server.url + "/?playbook=loss-spike")
    first = page.locator("details.rec").first
    assert first.get_attribute("open") is None
    first.locator("summary").click()
    expect(first).to_have_attribute("open", "")
    body = first.locator(".body")
    expect(body).to_contain_text("job_name")
    expect(body).to_contain_text("scale_lr")
    expect(body.locator(".params", has_text="factor")).to_contain_text("factor 0.5")
    expect(body).to_contain_text("LR 0.0005 → 0.00025")  # the second spike halved the halved LR
    expect(body).to_contain_text('"restored_step": 1200')
    expect(body).to_contain_text(rc.identity)
    shot(page, "history-expanded.png")


def test_alert_text_is_shown_as_text_never_run(site: tuple[Server, Any], page: Page, dialogs: list[str]) -> None:
    server, _ = site
    page.goto(server.url + "/?alertname=TrainingThroughputDrop")
    hostile = page.locator("details.rec", has_text="bad label")
    hostile.locator("summary").click()
    expect(hostile.locator(".body")).to_contain_text("<script>alert('pwned')</script>")
    assert page.locator("details.rec img").count() == 0
    page.wait_for_timeout(200)  # an onerror handler would have fired by now
    assert dialogs == []


def test_the_target_view_draws_the_timeline_and_the_lr_before_and_after(site: tuple[Server, Any],
                                                                          page: Page) -> None:
    server, _ = site
    page.goto(server.url + "/")
    page.locator("#live a", has_text="llama-ft-01").click()
    page.wait_for_url("**/targets/job/llama-ft-01")
    dots = page.locator("#timeline svg circle.dot")
    expect(dots).to_have_count(3)
    assert {d.get_attribute("class") for d in dots.all()} == {"dot st-applied", "dot st-partially_applied"}
    xs = [float(d.get_attribute("cx")) for d in dots.all()]
    assert xs == sorted(xs)  # left to right in time
    lanes = page.locator("#timeline svg text.lane").all_text_contents()
    assert lanes == ["gpu-memory-high", "loss-spike"]
    expect(page.locator("#lr-chart svg path.lrline")).to_have_count(1)
    expect(page.locator("#lr-chart svg circle.after")).to_have_count(2)
    # After sits below before on the chart (higher y), as the LR went down each time.
    befores = [float(c.get_attribute("cy")) for c in page.locator("#lr-chart circle.before").all()]
    afters = [float(c.get_attribute("cy")) for c in page.locator("#lr-chart circle.after").all()]
    assert all(a > b for a, b in zip(afters, befores))
    table = page.locator("#lr-table tr")
    expect(table).to_have_count(3)
    expect(table.nth(1)).to_contain_text("0.0005")
    expect(table.nth(1)).to_contain_text("0.00025")
    expect(table.nth(2)).to_contain_text("0.001")
    shot(page, "target.png")

    dots.first.click()  # a dot opens its record below
    expect(page.locator("details.rec[open]")).to_have_count(1)


def test_the_page_refreshes_itself_and_keeps_open_records_open(site: tuple[Server, Any], page: Page,
                                                                make_app: Any) -> None:
    server, _ = site
    page.goto(server.url + "/")
    rows = page.locator("details.rec")
    expect(rows).to_have_count(6)
    rows.nth(2).locator("summary").click()
    opened = rows.nth(2).get_attribute("id")
    other = make_app()  # another app on the same Redis, as another worker would be
    body = alert("TrainingThroughputDrop", "f1", job_name="late-job")
    assert post_json(other.test_client(), "/webhook", body).status_code == 200
    expect(rows).to_have_count(7, timeout=15000)
    expect(rows.first).to_contain_text("late-job")
    expect(page.locator("details.rec[open]")).to_have_count(1)
    assert page.locator("details.rec[open]").get_attribute("id") == opened
    expect(page.locator("#updated")).to_contain_text("updated")


def test_a_bad_filter_is_explained_on_the_page(site: tuple[Server, Any], page: Page) -> None:
    server, _ = site
    resp = page.goto(server.url + "/?status=exploded")
    assert resp is not None and resp.status == 400
    expect(page.locator(".error")).to_contain_text("status must be one of")
    resp = page.goto(server.url + "/targets/pod/llama-ft-01")
    assert resp is not None and resp.status == 404
    expect(page.locator(".error")).to_contain_text("There is no target")


def test_paging_follows_the_history_cursor(site: tuple[Server, Any], page: Page) -> None:
    server, _ = site
    page.goto(server.url + "/?limit=4")
    expect(page.locator("details.rec")).to_have_count(4)
    first_page = page.locator("details.rec").evaluate_all("els => els.map(e => e.id)")
    page.click("a[rel=next]")
    expect(page.locator("details.rec")).to_have_count(2)
    second_page = page.locator("details.rec").evaluate_all("els => els.map(e => e.id)")
    assert not set(first_page) & set(second_page)
    assert sorted(first_page + second_page, reverse=True) == first_page + second_page
    expect(page.locator("a", has_text="newest")).to_be_visible()


def test_the_page_helpers_escape_every_value_and_link_where_url_for_does(app: Any) -> None:
    """badge, outcome_badge, target_link, lr_change and the record and target links are Python, not Jinja
    macros (a page of 50 records calls them hundreds of times): they escape what they are given, and link
    exactly where url_for does, under the prefix the app is mounted at too."""
    from flask import url_for

    from trainmedic.service.web import ui

    rid = "01JABCDEFGHJKMNPQRSTVWXYZ0~job~llm:a@b.c_d-e"
    for prefix in ("", "/ops/trainmedic"):
        with app.test_request_context("/", base_url=f"http://example.com{prefix}"):
            assert ui.record_url(rid) == url_for("ui.record", rid=rid) == f"{prefix}/records/{rid}"
            assert ui.target_url("node", "gpu-01:9100") == url_for("ui.target", kind="node", name="gpu-01:9100")
            assert ui.target_link({"kind": "job", "name": "a<b"}) == (
                f'<a href="{prefix}/targets/job/a%3Cb"><span class="kind">job</span>a&lt;b</a>')
    with app.test_request_context("/"):
        # Icons are inline SVG (no font needs the glyph); a status without one gets none.
        half = ui.icon("half")
        assert half.startswith('<svg class="ico" viewBox="0 0 16 16" aria-hidden="true"') and ui.icon("nope") == ""
        assert ui.badge("partially_applied") == (
            f'<span class="badge st-partially_applied">{half}partially applied</span>')
        assert ui.badge("<i>x", "chip") == '<span class="chip st-&lt;i&gt;x">&lt;i&gt;x</span>'
        assert ui.outcome_badge({"status": "effective"}, "chip") == (
            f'<span class="chip oc-effective">{ui.icon("check")}effective</span>')
        assert ui.outcome_badge({"status": '"><script>'}) == (
            '<span class="badge oc-&#34;&gt;&lt;script&gt;">&#34;&gt;&lt;script&gt;</span>')
        assert ui.action_chip({"action": "a<b", "status": "skipped"}) == (
            f'<span class="chip st-skipped" title="a&lt;b: skipped">{ui.icon("dash")}a&lt;b</span>')
        assert ui.soft("GPUMemoryUsageHigh") == "GPUMemory<wbr>Usage<wbr>High"
        assert ui.soft("a_b<c") == "a_<wbr>b&lt;c"
        assert ui.stamp("2026-11-22T01:25:24.115697517Z") == (
            '<time datetime="2026-11-22T01:25:24.115697517Z">2026-11-22 01:25:24 UTC</time>')
        assert ui.stamp("<not a time>") == "&lt;not a time&gt;" and ui.stamp(None) == "—"
        assert ui.params_list({"reason": "a <b>", "factor": 0.5}) == (
            '<div class="params"><div><span class="k">reason</span> <span class="v">&#34;a &lt;b&gt;&#34;</span></div>'
            '<div><span class="k">factor</span> <span class="v">0.5</span></div></div>')
        assert ui.params_list({}) == '<span class="muted">none</span>'
        assert ui.target_link({"kind": "job", "name": ""}) == (
            '<span class="kind">job</span><span class="muted">none</span>')
        assert ui.lr_change({"old_lr": [0.001, 0.001], "new_lr": [0.0005, 0.0005]}) == (
            '\n<span class="lr" title="learning rate of each param group, before → after">'
            'LR 0.001 (×2 groups) → 0.0005 (×2 groups)</span>')
        assert ui.lr_change({"old_lr": ["<b>"], "new_lr": [1.0]}).count("&lt;b&gt;") == 1
        assert ui.lr_change({"old_lr": [], "new_lr": [0.1]}) == ui.lr_change(None) == ui.lr_change({}) == ""
        # The pages' environment reads a dict's keys first, and its methods when no key has their name.
        assert isinstance(app.jinja_env, ui.PageEnvironment)
        assert app.jinja_env.from_string("{{ d.status }} {{ d.get('n') }} {{ d.x is defined }} {{ o.real }}").render(
            d={"status": "applied", "n": 2}, o=3) == "applied 2 False 3"
