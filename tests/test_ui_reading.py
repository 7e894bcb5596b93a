"""What the pages say at a glance, in a real headless Chromium: repeats folded under the remediation they repeat,
every outcome counted, actions numbered from 1, chart keys apart and readable at 800 px, results rounded with
the exact value on hover, a closed job no longer live, the playbook's description, a log-out button like the
others."""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from playwright.sync_api import Browser, Page, expect

from tests.conftest import post_json
from tests.support.browser import Server
from tests.support.pages import alert
from trainmedic.client import RemediationClient
from trainmedic.client.wire import keys
from trainmedic.service.web import chart_markers, folds
from trainmedic.service.web.charts import Frame

JOB = "llama-3-8b-sft-0412"
ALICE = "alice-token-" + "0123456789abcdef" * 2
PLAYBOOKS = """
playbooks:
  - name: loss-spike
    description: Roll back to the last good checkpoint and halve the LR after a loss spike.
    matchers: ['alertname="TrainingLossSpike"']
    target: job
    actions:
      - rollback_checkpoint: {}
      - scale_lr: {factor: 0.5, min_lr: 1.0e-7}
    cooldown: 10m
  - name: gpu-memory-high
    matchers: ['alertname="GPUMemoryUsageHigh"']
    target: job
    actions:
      - reduce_batch_size: {factor: 0.5, min: 1}
"""
REPEATS = 11


@pytest.fixture
def scene(make_app: Any, r: redis.Redis, redis_url: str, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A job whose loss spike was remediated (then raised 11 more times within the cooldown), and whose batch
    size handler failed; the service on a real HTTP server."""
    (tmp_path / "pb.yaml").write_text(PLAYBOOKS)
    (tmp_path / "operators.tokens").write_text(f"alice {ALICE}\n")
    app = make_app(playbooks=str(tmp_path / "pb.yaml"), operator_tokens_file=str(tmp_path / "operators.tokens"),
                   UI_REFRESH_SECONDS=3600)
    http = app.test_client()
    opt = torch.optim.SGD(torch.nn.Linear(4, 1).parameters(), lr=3e-4)
    rc = RemediationClient(job=JOB, redis_url=redis_url, optimizer=opt, heartbeat_interval=0.3)
    rc.register("rollback_checkpoint", lambda p: {"restored_step": 12000, "loss_at_checkpoint": 2.0417823791503906})

    def fails(params: dict) -> dict:
        raise RuntimeError("the loader cannot shrink its batches now")
    rc.register("reduce_batch_size", fails)
    beat = keys.heartbeat(keys.Target("job", JOB))
    deadline = time.monotonic() + 10
    while "reduce_batch_size" not in json.loads(r.get(beat) or "{}").get("actions", []):
        assert time.monotonic() < deadline, "no heartbeat listing the handlers"
        rc.poll(step=0)
        time.sleep(0.05)
    step = 0

    def remediate(body: dict) -> str:
        nonlocal step
        [rec] = post_json(http, "/webhook", body).get_json()["remediations"]
        until = time.monotonic() + 10
        while http.get(f"/remediations/{rec['id']}").get_json()["status"] == "dispatched":
            assert time.monotonic() < until, "not acknowledged"
            step += 1
            rc.poll(step=step)
            time.sleep(0.01)
        return str(rec["id"])

    failed = remediate(alert("GPUMemoryUsageHigh", "m1", job_name=JOB))
    spike = remediate(alert("TrainingLossSpike", "s1", job_name=JOB))
    for i in range(REPEATS):  # each a new episode, all within the cooldown
        [rec] = post_json(http, "/webhook", alert("TrainingLossSpike", f"s{i + 2}", job_name=JOB)).get_json()[
            "remediations"]
        assert (rec["status"], rec["reason"]) == ("skipped", "cooldown")
    app.extensions["trainmedic"].reconciler.tick()  # the failed record's outcome: unknown
    server = Server(app)
    try:
        yield {"server": server, "rc": rc, "spike": spike, "failed": failed, "r": r}
    finally:
        server.stop()
        rc.close()


def at(browser: Browser, width: int) -> Page:
    return browser.new_context(viewport={"width": width, "height": 900}).new_page()


def test_repeats_fold_under_the_remediation_every_outcome_counts_and_a_closed_job_is_not_live(
        scene: dict[str, Any], browser: Browser) -> None:
    url = scene["server"].url
    page = at(browser, 1280)
    page.goto(url + "/")
    # One line for the remediation, one for its eleven repeats: the failed record stays in the first screen.
    expect(page.locator("details.rec")).to_have_count(2)
    repeats = page.locator("details.repeats")
    expect(repeats).to_have_count(1)
    expect(repeats).to_contain_text(f"{REPEATS} more alerts for this job skipped as repeats of it (cooldown")
    spike_row = page.locator(f"[id='rec-{scene['spike']}']")
    assert spike_row.bounding_box()["y"] < repeats.bounding_box()["y"]  # type: ignore[index]
    failed_row = page.locator(f"[id='rec-{scene['failed']}']")
    assert failed_row.bounding_box()["y"] + 40 < 900  # type: ignore[index]
    repeats.locator("summary").click()
    expect(repeats.locator("ol.repeat-list li")).to_have_count(REPEATS)
    expect(repeats.locator("ol.repeat-list li").first).to_contain_text("cooldown")
    # The strip counts every outcome: the failed record's is unknown.
    expect(page.locator(".striprow", has_text="gpu-memory-high")).to_contain_text(
        "0 effective · 0 ineffective · 0 pending · 1 unknown")
    expect(page.locator(".striprow", has_text="gpu-memory-high").locator(".seg.oc-unknown")).to_have_text("1")
    # The job is live until it calls close(); then at once no longer (no wait for its heartbeat to run out).
    expect(page.locator("#live")).to_contain_text(JOB)
    scene["rc"].close()
    page.goto(url + "/")
    expect(page.locator("#live")).to_contain_text("Live targets (0)")
    page.goto(f"{url}/targets/job/{JOB}")
    expect(page.locator("#live")).to_contain_text("Not live")
    assert scene["r"].ttl(keys.heartbeat(keys.Target("job", JOB))) > 0  # its heartbeat ran its course: not renewed
    page.context.close()


def test_the_record_page_numbers_from_one_rounds_results_keys_its_chart_and_says_what_the_playbook_is_for(
        scene: dict[str, Any], browser: Browser) -> None:
    url = scene["server"].url
    page = at(browser, 800)
    page.goto(f"{url}/records/{scene['spike']}")
    expect(page.locator("#playbook-description")).to_have_text(
        "Roll back to the last good checkpoint and halve the LR after a loss spike.")
    rows = page.locator("#record table.acts tbody tr")
    assert [rows.nth(i).locator("td").first.inner_text() for i in range(rows.count())] == ["1", "2"]
    # Results rounded, the exact value on hover.
    result = rows.first.locator("pre.result")
    expect(result).to_contain_text('"loss_at_checkpoint": 2.042,')
    assert "2.0417823791503906" in (result.get_attribute("title") or "")
    assert "2.0417823791503906" not in result.inner_text()
    # The actions answered within a second of each other: one numbered key, and the list says what it holds,
    # in page text at least 12 px high at 800 px.
    keys_drawn = page.locator("#around svg .mkey")
    assert keys_drawn.count() >= 1
    expect(page.locator("#around ol.mkeys li").first).to_contain_text("fired")  # five minutes before them
    acks = page.locator("#around ol.mkeys li", has_text="rollback_checkpoint applied")
    expect(acks).to_contain_text("scale_lr applied")
    size = acks.evaluate("e => parseFloat(getComputedStyle(e).fontSize)")
    assert size >= 12
    boxes = [k.bounding_box() for k in keys_drawn.all()]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert a["x"] + a["width"] <= b["x"] or b["x"] + b["width"] <= a["x"], (a, b)  # type: ignore[index]
    page.context.close()


def test_the_log_out_button_looks_like_the_pages_other_buttons(scene: dict[str, Any], browser: Browser) -> None:
    url = scene["server"].url
    page = at(browser, 1280)
    page.goto(f"{url}/login?next=/")
    page.locator("#login input[name=token]").fill(ALICE)
    page.locator("#login button").click()
    page.wait_for_url(url + "/")
    style = "e => { const s = getComputedStyle(e); return [s.borderRadius, s.fontWeight, s.cursor, s.borderStyle] }"
    logout = page.locator("header form.who button").evaluate(style)
    assert logout == page.locator("form.filters button").evaluate(style) == ["6px", "600", "pointer", "solid"]
    height = page.locator("header form.who button").bounding_box()["height"]  # type: ignore[index]
    assert 24 <= height <= 40
    page.context.close()


# -- the parts behind them


def rec(rid: str, status: str = "applied", reason: str | None = None, fingerprint: str = "f",
        starts: str = "2026-11-29T10:00:00.1Z", playbook: str = "loss-spike", job: str = JOB) -> dict:
    return {"id": rid, "status": status, "reason": reason, "playbook": playbook,
            "target": {"kind": "job", "name": job}, "alert": {"fingerprint": fingerprint, "starts_at": starts}}


def test_repeats_fold_under_the_nearest_older_record_they_repeat() -> None:
    items = [  # newest first
        rec("r5", "skipped", "cooldown", "f3"),
        rec("o1", "failed", playbook="other"),
        rec("r4", "skipped", "cooldown", "f2"),
        rec("a2", "applied", fingerprint="f1", starts="2026-11-29T11:00:00Z"),
        rec("r3", "skipped", "budget_exhausted", "f0", "2026-11-29T09:00:00.9Z"),  # an episode answered already
        rec("r2", "skipped", "cooldown", "f0"),
        rec("a1", "applied", fingerprint="f0", starts="2026-11-29T09:00:00.2Z"),
        rec("r1", "skipped", "cooldown", job="other-job"),  # its remediation is on an older page
        rec("s1", "skipped", "budget_exhausted", "new"),  # skipped, but not a repeat: its own line
    ]
    rows = folds.fold(items)
    assert [(r.rec["id"] if r.rec else None, [x["id"] for x in r.repeats]) for r in rows] == [
        ("o1", []), ("a2", ["r5", "r4"]), ("a1", ["r3", "r2"]), (None, ["r1"]), ("s1", [])]


def test_markers_close_in_time_share_a_key_and_keys_never_overlap() -> None:
    frame = Frame(width=900, left=80, top=24)
    acks = [{"action": name, "status": "applied", "acked_at": f"2026-11-29T10:00:{sec}Z"}
            for name, sec in (("rollback_checkpoint", "00.05"), ("scale_lr", "00.06"), ("save_checkpoint", "00.9"))]
    records = [{"playbook": "loss-spike", "created_at": "2026-11-29T10:00:00Z", "actions": acks,
                "outcome": {"resolved_at": "2026-11-29T10:30:00Z"}}]
    anchor = {"alert": {"starts_at": "2026-11-29T10:00:00Z"}}
    t0 = 1_795_946_340.0  # 2026-11-29T09:59:00Z
    marked = chart_markers.marked(anchor, records, t0, t0 + 3600, frame)
    assert len(marked.lines) == 5
    assert [[w for _, w in k.words] for k in marked.keys] == [
        ["fired", "rollback_checkpoint applied", "scale_lr applied", "save_checkpoint applied"], ["resolved"]]
    assert [k.number for k in marked.keys] == [1, 2]
    xs = [k.x for k in marked.keys]
    assert all(b - a >= chart_markers.KEY_GAP for a, b in zip(xs, xs[1:]))
    assert all(frame.left + chart_markers.KEY_R <= x <= frame.x1 - chart_markers.KEY_R for x in xs)
