"""Episodes that survive flapping: what a firing changed is undone by the final resolve, once (Guarantees 1-3)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from trainmedic.client.wire import keys
from trainmedic.service.store import record as records

from tests.conftest import post_json, write_playbooks
from tests.support.jobs import episode

NODE = "gpu-node-4"
PLAYBOOKS = """
playbooks:
  - name: gpu-hot
    matchers: ['alertname="GPUTemperatureHigh"']
    target: node
    actions: [{power_limit: {fraction: 0.8}}]
    on_resolved: [{restore_power_limit: {}}]
    cooldown: 10m
    resolve_timeout: 2s
  - name: gpu-hot-again
    matchers: ['alertname="GPUHotNoCooldown"']
    target: node
    actions: [{power_limit: {fraction: 0.8}}]
    on_resolved: [{restore_power_limit: {}}]
  - name: gpu-hot-held
    matchers: ['alertname="GPUHotHeld"']
    target: node
    actions: [{power_limit: {fraction: 0.8}}]
    on_resolved: [{restore_power_limit: {}}]
    cooldown: 10m
    approval: true
"""
T1, T2 = "2026-11-22T01:00:00.123456789Z", "2026-11-22T01:05:00.987Z"


@pytest.fixture
def app(make_app: Any, tmp_path: Path) -> Any:
    return make_app(playbooks=str(write_playbooks(tmp_path / "pb.yaml", PLAYBOOKS)))


def notify(http: Any, status: str, starts_at: str, alertname: str = "GPUTemperatureHigh",
           fingerprint: str = "00000000000f1a90") -> list[dict]:
    """One Alertmanager notification of one alert; the records it made."""
    # Alertmanager sends startsAt with nanoseconds when firing and without them when resolved.
    starts = starts_at if status == "firing" else starts_at.split(".")[0] + "Z"
    body = {"version": "4", "status": status, "receiver": "trainmedic", "alerts": [{
        "status": status, "labels": {"alertname": alertname, "node": NODE, "gpu_id": "0"}, "annotations": {},
        "startsAt": starts, "endsAt": "0001-01-01T00:00:00Z" if status == "firing" else "2026-11-22T02:00:00Z",
        "fingerprint": fingerprint}]}
    resp = post_json(http, "/webhook", body)
    assert resp.status_code == 200, resp.get_json()
    return list(resp.get_json()["remediations"])


def actions_of(r: Any, made: list[dict]) -> list[tuple[str, str]]:
    """(status, first action) of each record made."""
    out = []
    for m in made:
        rec = records.get(r, m["id"])
        assert rec is not None
        out.append((rec["status"], rec["actions"][0]["action"] if rec["actions"] else ""))
    return out


def test_a_flap_alertmanager_never_resolved_is_still_undone_once_by_the_final_resolve(app: Any, r: Any) -> None:
    http = app.test_client()
    assert actions_of(r, notify(http, "firing", T1)) == [("dispatched", "power_limit")]
    # Resolved and fired again within one group_interval: no resolve was sent, the new firing starts later.
    flap = notify(http, "firing", T2)
    assert [(m["status"], m["reason"]) for m in flap] == [("skipped", "cooldown")]
    undo = notify(http, "resolved", T2)
    assert actions_of(r, undo) == [("dispatched", "restore_power_limit")]
    rec = records.get(r, undo[0]["id"])
    assert rec is not None and rec["on_resolved"] is True
    # Alertmanager resends the resolve; a stale resolve of the first episode arrives late: nothing more.
    assert notify(http, "resolved", T2) == [] and notify(http, "resolved", T1) == []


def test_a_stale_resolve_of_an_older_episode_neither_undoes_nor_closes_the_newer(app: Any, r: Any) -> None:
    http = app.test_client()
    notify(http, "firing", T1, "GPUHotNoCooldown")
    assert actions_of(r, notify(http, "resolved", T1, "GPUHotNoCooldown")) == [("dispatched", "restore_power_limit")]
    assert actions_of(r, notify(http, "firing", T2, "GPUHotNoCooldown")) == [("dispatched", "power_limit")]
    assert notify(http, "resolved", T1, "GPUHotNoCooldown") == []  # E1's resolve, delivered again, late
    assert notify(http, "firing", T2, "GPUHotNoCooldown") == []  # E2 is still open: a resend of it
    assert actions_of(r, notify(http, "resolved", T2, "GPUHotNoCooldown")) == [("dispatched", "restore_power_limit")]


def test_a_firing_retry_that_arrives_after_its_resolve_is_a_duplicate(app: Any, r: Any) -> None:
    http = app.test_client()
    notify(http, "firing", T1, "GPUHotNoCooldown")
    notify(http, "resolved", T1, "GPUHotNoCooldown")
    assert notify(http, "firing", T1, "GPUHotNoCooldown") == []  # a delayed retry of the closed episode
    ep = episode(r, keys.Target("node", NODE), "gpu-hot-again", "00000000000f1a90")
    assert ep["closed"] == "2026-11-22T01:00:00Z" and "open" not in ep
    assert r.pttl(keys.target_state(keys.Target("node", NODE))) > 24 * 3600 * 1000


def test_an_earlier_start_from_a_second_prometheus_is_the_same_episode(app: Any, r: Any) -> None:
    http = app.test_client()
    notify(http, "firing", T2, "GPUHotNoCooldown")
    # The same alert merged from another Prometheus server, which saw it earlier.
    assert notify(http, "firing", T1, "GPUHotNoCooldown") == []
    assert actions_of(r, notify(http, "resolved", T1, "GPUHotNoCooldown")) == [("dispatched", "restore_power_limit")]


def test_a_late_retry_with_the_start_from_before_a_merge_is_a_duplicate_while_open_and_after_the_resolve(
        app: Any, r: Any) -> None:
    http = app.test_client()
    assert len(notify(http, "firing", T2, "GPUHotNoCooldown")) == 1
    assert notify(http, "firing", T1, "GPUHotNoCooldown") == []  # merged: Alertmanager moved startsAt earlier
    assert notify(http, "firing", T2, "GPUHotNoCooldown") == []  # a retry that still carries the first start
    assert actions_of(r, notify(http, "resolved", T1, "GPUHotNoCooldown")) == [("dispatched", "restore_power_limit")]
    assert notify(http, "firing", T2, "GPUHotNoCooldown") == []  # and after the resolve
    assert notify(http, "firing", T1, "GPUHotNoCooldown") == []
    # A firing that starts later than every start of that episode is a new episode.
    assert [m["status"] for m in notify(http, "firing", "2026-11-22T01:10:00.5Z", "GPUHotNoCooldown")] == [
        "dispatched"]


def test_a_flap_of_an_approved_remediation_is_undone_and_the_other_hold_cancelled(app: Any, r: Any) -> None:
    http = app.test_client()
    [held] = notify(http, "firing", T1, "GPUHotHeld")
    assert held["status"] == "pending_approval"
    assert post_json(http, f"/remediations/{held['id']}/approve", {}).status_code == 200
    [flap] = notify(http, "firing", T2, "GPUHotHeld")  # the alert flapped; this episode is cooled down
    assert flap["reason"] == "cooldown"
    assert actions_of(r, notify(http, "resolved", T2, "GPUHotHeld")) == [("dispatched", "restore_power_limit")]


def test_a_hold_nobody_approved_is_cancelled_by_the_final_resolve_of_a_flapping_alert(app: Any, r: Any) -> None:
    http = app.test_client()
    [first] = notify(http, "firing", T1, "GPUHotHeld")
    notify(http, "firing", T2, "GPUHotHeld")
    assert notify(http, "resolved", T2, "GPUHotHeld") == []  # nothing was throttled, so nothing to undo
    rec = records.get(r, first["id"])
    assert rec is not None and (rec["status"], rec["reason"]) == ("expired", "resolved_before_approval")
    late = post_json(http, f"/remediations/{first['id']}/approve", {})
    assert late.status_code == 409  # approving now would throttle a GPU that nothing would restore


def test_without_a_resolve_on_resolved_runs_after_resolve_timeout_from_the_last_firing(app: Any, r: Any) -> None:
    http = app.test_client()
    reconciler = app.extensions["trainmedic"].reconciler
    t0 = time.time()
    notify(http, "firing", T1)
    time.sleep(1.2)
    notify(http, "firing", T1)  # a resend: the alert still fires, so the timeout counts from here
    assert reconciler.tick(t0 + 2.6).resolved == []
    report = reconciler.tick(time.time() + 2.1)
    [rid] = report.resolved
    rec = records.get(r, rid)
    assert rec is not None and (rec["status"], rec["reason"]) == ("dispatched", "resolved_not_notified")
    assert [a["action"] for a in rec["actions"]] == ["restore_power_limit"] and rec["on_resolved"] is True
    # The episode is closed: a late resolve undoes nothing more, a late firing retry is a duplicate.
    assert notify(http, "resolved", T1) == [] and notify(http, "firing", T1) == []
    assert reconciler.tick(time.time() + 10).resolved == []


def test_a_dry_run_episode_is_undone_in_dry_run(make_app: Any, r: Any, tmp_path: Path) -> None:
    app = make_app(playbooks=str(write_playbooks(tmp_path / "pb.yaml", PLAYBOOKS)), dry_run=True)
    http = app.test_client()
    assert [m["status"] for m in notify(http, "firing", T1, "GPUHotNoCooldown")] == ["dry_run"]
    assert [m["status"] for m in notify(http, "resolved", T1, "GPUHotNoCooldown")] == ["dry_run"]
    assert r.xlen(keys.mailbox(keys.Target("node", NODE))) == 0
