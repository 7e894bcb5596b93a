"""Flapping through the real Alertmanager (one remediation per firing episode, however often it is sent): the
service under gunicorn with its reconciler threads, a real node agent on the NVML stand-in, and alerts pushed
to Alertmanager as Prometheus pushes them. What a firing throttled is restored once, by the final resolve,
whatever happened between."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import requests

from trainmedic.client.wire import keys
from trainmedic.service.store import record as records
from trainmedic.service.embedded_redis import free_port

from tests.conftest import TOKEN, post_json, write_playbooks
from tests.support.faults import am_active, am_alert, am_post, history, metric, now_utc, post, wait_for
from tests.support.stack import ALERTMANAGER, ALERTMANAGER_CONFIG, Alertmanager, _Child

NODE = "gpu-node-7"
PLAYBOOKS = """\
playbooks:
  - name: gpu-hot
    matchers: ['alertname="GPUTemperatureHigh"']
    target: node
    actions: [{power_limit: {fraction: 0.8}}]
    on_resolved: [{restore_power_limit: {}}]
    cooldown: 10m
  - name: gpu-hot-held
    matchers: ['alertname="GPUHotHeld"']
    target: node
    actions: [{power_limit: {fraction: 0.8}}]
    on_resolved: [{restore_power_limit: {}}]
    cooldown: 10m
    approval: true
"""
# Alertmanager's timing: a flap inside one group_interval is never notified as a resolve; the new firing is
# only sent with the next repeat (Alertmanager dedups by labels, not by startsAt).
GROUP_WAIT, GROUP_INTERVAL, REPEAT_INTERVAL = "1s", "3s", "6s"


def labels(alertname: str) -> dict:
    return {"alertname": alertname, "node": NODE, "gpu_id": "0", "severity": "warning"}


class QuietAlertmanager(_Child):
    """An Alertmanager whose receiver does not send resolves (send_resolved: false): only its API tells."""

    def __init__(self, workdir: Path, webhook_url: str, port: int):
        self.port = port
        self.url = f"http://127.0.0.1:{self.port}"
        conf = workdir / "alertmanager-quiet.yml"
        conf.write_text(ALERTMANAGER_CONFIG.format(url=webhook_url, token=TOKEN, group_wait=GROUP_WAIT,
                                                   group_interval=GROUP_INTERVAL, repeat_interval=REPEAT_INTERVAL)
                        .replace("send_resolved: true", "send_resolved: false"))
        self._spawn([ALERTMANAGER, f"--config.file={conf}", f"--storage.path={workdir / 'am-quiet-data'}",
                     f"--web.listen-address=127.0.0.1:{self.port}", "--cluster.listen-address="],
                    workdir / "alertmanager-quiet.log")
        self._wait_ready("/-/ready", 20)


def firing_records(url: str, playbook: str) -> list[dict]:
    return [i for i in history(url, playbook=playbook) if not i.get("on_resolved")]


def undo_records(url: str, playbook: str) -> list[dict]:
    return [i for i in history(url, playbook=playbook) if i.get("on_resolved")]


def start(gunicorn: Any, agents: Any, r: Any, tmp_path: Path, nvml_lib: Path, nvml_state: Any, **env: str) -> Any:
    pb = write_playbooks(tmp_path / "flapping.yaml", PLAYBOOKS)
    server = gunicorn(workers=2, TRAINMEDIC_PLAYBOOKS=str(pb), **env)
    agents(NODE, lib_dir=nvml_lib, state=nvml_state).wait_ready(r)
    assert nvml_state.limit_w(0) == 700
    return server


def flap(am_url: str, lab: dict, first_start: Any) -> Any:
    """Resolve the alert and fire it again with a later startsAt, in one push: inside one group_interval."""
    second = now_utc()
    am_post(am_url, [am_alert(lab, first_start, now_utc(-0.5)), am_alert(lab, second, now_utc(600))])
    return second


def resolve(am_url: str, lab: dict, start_at: Any) -> None:
    am_post(am_url, [am_alert(lab, start_at, now_utc(-0.5))])


def applied(url: str, rid: str) -> bool:
    return requests.get(f"{url}/remediations/{rid}", timeout=5).json()["status"] == "applied"


def test_a_flap_alertmanager_never_resolved_is_skipped_by_cooldown_and_the_final_resolve_restores_700_w_once(
        gunicorn: Any, agents: Any, r: Any, tmp_path: Path, nvml_lib: Path, nvml_state: Any) -> None:
    server = start(gunicorn, agents, r, tmp_path, nvml_lib, nvml_state)
    am = Alertmanager(tmp_path, server.url + "/webhook", TOKEN, GROUP_WAIT, GROUP_INTERVAL, REPEAT_INTERVAL)
    try:
        lab = labels("GPUTemperatureHigh")
        first = now_utc()
        am_post(am.url, [am_alert(lab, first, now_utc(600))])
        [throttle] = wait_for(lambda: firing_records(server.url, "gpu-hot"), 20, "the firing notification")
        wait_for(lambda: applied(server.url, throttle["id"]), 20, "the throttle to be applied")
        assert nvml_state.limit_w(0) == 560

        flap(am.url, lab, first)
        skipped = wait_for(lambda: [i for i in firing_records(server.url, "gpu-hot") if i["status"] == "skipped"],
                           30, "the flapped firing (sent with Alertmanager's next repeat)")
        assert [(i["status"], i["reason"]) for i in skipped] == [("skipped", "cooldown")]
        assert skipped[0]["alert"]["starts_at"] > throttle["alert"]["starts_at"]  # a later episode
        # The premise: Alertmanager never notified the flap's resolve.
        assert metric(server.url, "trainmedic_alerts_received_total", status="resolved") == 0
        assert undo_records(server.url, "gpu-hot") == []
        assert nvml_state.limit_w(0) == 560

        resolve(am.url, lab, now_utc(-1))
        [undo] = wait_for(lambda: undo_records(server.url, "gpu-hot"), 20, "the final resolve's on_resolved")
        wait_for(lambda: applied(server.url, undo["id"]), 20, "the restore to be applied")
        assert nvml_state.limit_w(0) == 700
        assert undo["reason"] is None and undo["actions"][0]["action"] == "restore_power_limit"
        time.sleep(7)  # two more group intervals: Alertmanager and the reconcilers add nothing
    finally:
        am.stop()
    assert len(undo_records(server.url, "gpu-hot")) == 1
    assert sorted((i["status"], i["reason"]) for i in firing_records(server.url, "gpu-hot")) == [
        ("applied", None), ("skipped", "cooldown")]
    assert nvml_state.limit_w(0) == 700


def test_a_held_throttle_approved_then_flapped_is_restored_once_when_the_alert_resolves(
        gunicorn: Any, agents: Any, r: Any, tmp_path: Path, nvml_lib: Path, nvml_state: Any) -> None:
    server = start(gunicorn, agents, r, tmp_path, nvml_lib, nvml_state)
    am = Alertmanager(tmp_path, server.url + "/webhook", TOKEN, GROUP_WAIT, GROUP_INTERVAL, REPEAT_INTERVAL)
    try:
        lab = labels("GPUHotHeld")
        first = now_utc()
        am_post(am.url, [am_alert(lab, first, now_utc(600))])
        [held] = wait_for(lambda: firing_records(server.url, "gpu-hot-held"), 20, "the firing notification")
        assert held["status"] == "pending_approval"
        time.sleep(1)
        assert nvml_state.limit_w(0) == 700  # held: nothing changed yet

        assert post(server.url, f"/remediations/{held['id']}/approve", {"comment": "go"})
        wait_for(lambda: applied(server.url, held["id"]), 20, "the approved throttle to be applied")
        assert nvml_state.limit_w(0) == 560

        second = flap(am.url, lab, first)
        wait_for(lambda: [i for i in firing_records(server.url, "gpu-hot-held") if i["status"] == "skipped"],
                 30, "the flapped firing")
        assert metric(server.url, "trainmedic_alerts_received_total", status="resolved") == 0
        assert nvml_state.limit_w(0) == 560

        resolve(am.url, lab, second)
        [undo] = wait_for(lambda: undo_records(server.url, "gpu-hot-held"), 20, "the final resolve's on_resolved")
        wait_for(lambda: applied(server.url, undo["id"]), 20, "the restore to be applied")
        assert nvml_state.limit_w(0) == 700
        time.sleep(7)
    finally:
        am.stop()
    assert len(undo_records(server.url, "gpu-hot-held")) == 1
    firing = sorted((i["status"], i["reason"]) for i in firing_records(server.url, "gpu-hot-held"))
    assert firing == [("applied", None), ("skipped", "cooldown")]
    [approved] = [i for i in firing_records(server.url, "gpu-hot-held") if i["status"] == "applied"]
    assert approved["approved_by"] == "operator" and approved["approval_comment"] == "go"
    assert nvml_state.limit_w(0) == 700


def test_an_alert_alertmanager_drops_without_a_resolve_is_undone_by_the_reconciler_as_resolved_not_notified(
        gunicorn: Any, agents: Any, r: Any, tmp_path: Path, nvml_lib: Path, nvml_state: Any) -> None:
    # The service learns Alertmanager's address at start, and Alertmanager the service's: pick its port first.
    port = free_port()
    server = start(gunicorn, agents, r, tmp_path, nvml_lib, nvml_state,
                   TRAINMEDIC_ALERTMANAGER_URL=f"http://127.0.0.1:{port}", TRAINMEDIC_ALERTMANAGER_TRUST_AFTER="1")
    am = QuietAlertmanager(tmp_path, server.url + "/webhook", port)
    try:
        lab = labels("GPUTemperatureHigh")
        first = now_utc()
        am_post(am.url, [am_alert(lab, first, now_utc(600))])
        [throttle] = wait_for(lambda: firing_records(server.url, "gpu-hot"), 20, "the firing notification")
        wait_for(lambda: applied(server.url, throttle["id"]), 20, "the throttle to be applied")
        assert nvml_state.limit_w(0) == 560

        resolve(am.url, lab, first)
        resolved_at = time.monotonic()
        wait_for(lambda: not am_active(am.url), 10, "Alertmanager to drop the alert")
        # Within 30 s of the alert's last firing notification the reconcilers ask Alertmanager, and act.
        [undo] = wait_for(lambda: undo_records(server.url, "gpu-hot"), 45, "the reconciler's on_resolved")
        assert time.monotonic() - resolved_at < 45
        wait_for(lambda: applied(server.url, undo["id"]), 20, "the restore to be applied")
    finally:
        am.stop()
    assert (undo["status"], undo["reason"]) in (("dispatched", "resolved_not_notified"),
                                                ("applied", "resolved_not_notified"))
    assert undo["requested_by"] == "reconciler" and undo["actions"][0]["action"] == "restore_power_limit"
    assert metric(server.url, "trainmedic_alerts_received_total", status="resolved") == 0  # none was sent
    assert nvml_state.limit_w(0) == 700
    assert len(undo_records(server.url, "gpu-hot")) == 1


def test_an_alertmanager_too_young_to_trust_is_asked_again_within_30_s_not_after_the_resolve_timeout(
        make_app: Any, r: Any, tmp_path: Path) -> None:
    am = Alertmanager(tmp_path, "http://127.0.0.1:1/webhook", TOKEN, GROUP_WAIT, GROUP_INTERVAL, REPEAT_INTERVAL)
    try:
        app = make_app(playbooks=str(write_playbooks(tmp_path / "flapping.yaml", PLAYBOOKS)),
                       alertmanager_urls=(am.url,), alertmanager_trust_after=3600.0)
        body = {"version": "4", "status": "firing", "receiver": "trainmedic", "alerts": [{
            "status": "firing", "labels": labels("GPUTemperatureHigh"), "annotations": {},
            "startsAt": "2026-11-22T01:00:00.123Z", "endsAt": "0001-01-01T00:00:00Z", "fingerprint": "f1a90"}]}
        assert post_json(app.test_client(), "/webhook", body).status_code == 200
        rc = app.extensions["trainmedic"].reconciler
        target = keys.Target("node", NODE)
        member = keys.obligation_member("gpu-hot", "f1a90")
        t0 = time.time()
        # 31 s later the undo obligation is due: Alertmanager (which never heard of the alert) is too young.
        assert rc.tick(t0 + 31).resolved == []
        again = r.zscore(keys.due_items(target), member) / 1000
        assert again <= t0 + 31 + 30 + 1, f"asked again only {again - t0:.0f}s after the firing"
        rc.alertmanager.trust_after = 0.0  # it has been up long enough now
        [rid] = rc.tick(t0 + 62).resolved
    finally:
        am.stop()
    rec = records.get(r, rid)
    assert rec is not None and rec["on_resolved"] and rec["reason"] == "resolved_not_notified"
