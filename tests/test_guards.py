"""Guardrails under 4 gunicorn workers: cooldown, budget, approval (with expiry), dry run — exact counts."""
from __future__ import annotations

import itertools
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests

from trainmedic.client.wire import keys

from tests.conftest import AUTH, OP_AUTH, write_playbooks
from tests.support.jobs import wait_until
from tests.support.nvml import wait_record

PLAYBOOKS = """
playbooks:
  - name: cool
    matchers: ['alertname="CoolMe"']
    target: job
    actions: [{scale_lr: {factor: 0.5}}]
    cooldown: 10m
  - name: budget
    matchers: ['alertname="BudgetMe"']
    target: job
    actions: [{scale_lr: {factor: 0.5}}]
    max_runs: {count: 3, per: 1h}
  - name: short-budget
    matchers: ['alertname="ShortBudget"']
    target: job
    actions: [{scale_lr: {factor: 0.5}}]
    max_runs: {count: 2, per: 5s}  # a window the 8-request storm fits in on a loaded machine
  - name: hold
    matchers: ['alertname="GPUTemperatureHigh"']
    target: node
    actions: [{power_limit: {fraction: 0.8}}]
    on_resolved: [{restore_power_limit: {}}]
    approval: true
    approval_timeout: 5s
  - name: rehearse
    matchers: ['alertname="DryMe"']
    target: job
    actions: [{scale_lr: {factor: 0.5}}, {save_checkpoint: {}}]
    on_resolved: [{set_lr: {lr: 0.1}}]
    dry_run: true
"""

_fp = itertools.count(1)


def group(alertname: str, status: str = "firing", fingerprint: str | None = None, n: int = 1,
          **labels: str) -> dict:
    """An Alertmanager notification of n alerts with distinct fingerprints (one, if given)."""
    alerts = [{"status": status, "labels": {"alertname": alertname, "job_name": "llama-ft-01", **labels},
               "annotations": {}, "startsAt": "2026-11-22T01:25:24.115697517Z",
               "endsAt": "0001-01-01T00:00:00Z", "generatorURL": "",
               "fingerprint": fingerprint or f"{next(_fp):016x}"} for _ in range(n)]
    return {"receiver": "trainmedic", "status": status, "alerts": alerts, "groupLabels": {}, "commonLabels": {},
            "commonAnnotations": {}, "externalURL": "http://am", "version": "4", "groupKey": "{}:{}",
            "truncatedAlerts": 0}


@pytest.fixture
def service(gunicorn: Any, tmp_path: Path) -> Any:
    return gunicorn(workers=4, TRAINMEDIC_PLAYBOOKS=str(write_playbooks(tmp_path / "pb.yaml", PLAYBOOKS)))


def post(url: str, body: dict) -> dict:
    resp = requests.post(url + "/webhook", json=body, headers=AUTH, timeout=10)
    assert resp.status_code == 200, resp.text
    return resp.json()


def storm(url: str, bodies: list[dict]) -> list[dict]:
    """Post every body at once from 16 threads; every remediation of every answer."""
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda b: post(url, b), bodies))
    return [rem for a in answers for rem in a["remediations"]]


def dispatched_commands(r: Any) -> int:
    """Commands ever put into a mailbox (an applier takes its entries out as it claims them)."""
    return sum(r.xinfo_stream(k)["entries-added"] for k in r.scan_iter(match="trainmedic:*:mailbox"))


def test_cooldown_lets_exactly_one_of_40_concurrent_alerts_through_per_target(service, r) -> None:
    bodies = [group("CoolMe", job_name=job) for job in ("job-a", "job-b") for _ in range(20)]
    rems = storm(service.url, bodies)
    assert len(rems) == 40
    for job in ("job-a", "job-b"):
        mine = [x for x in rems if x["id"].endswith(f"~job~{job}")]
        assert sorted(x["status"] for x in mine) == ["dispatched"] + ["skipped"] * 19
        assert {x["reason"] for x in mine if x["status"] == "skipped"} == {"cooldown"}
        assert r.xlen(keys.mailbox(keys.Target("job", job))) == 1
    assert dispatched_commands(r) == 2
    skipped = requests.get(service.url + "/history", params={"status": "skipped", "limit": 500}).json()["items"]
    assert len(skipped) == 38 and {x["reason"] for x in skipped} == {"cooldown"}
    assert {a["status"] for x in skipped for a in x["actions"]} == {"skipped"}


def test_the_budget_allows_exactly_max_runs_of_40_concurrent_alerts(service, r) -> None:
    rems = storm(service.url, [group("BudgetMe") for _ in range(40)])
    statuses = sorted(x["status"] for x in rems)
    assert statuses == ["dispatched"] * 3 + ["skipped"] * 37
    assert {x["reason"] for x in rems if x["status"] == "skipped"} == {"budget_exhausted"}
    assert dispatched_commands(r) == 3


def test_the_budget_refills_when_its_window_passes(service, r) -> None:
    first = storm(service.url, [group("ShortBudget") for _ in range(8)])
    assert sum(x["status"] == "dispatched" for x in first) == 2
    time.sleep(5.2)
    second = storm(service.url, [group("ShortBudget") for _ in range(8)])
    assert sum(x["status"] == "dispatched" for x in second) == 2
    assert dispatched_commands(r) == 4


def test_a_resend_of_a_cooled_down_alert_is_a_duplicate_not_another_skip(service, r) -> None:
    body = group("CoolMe", job_name="job-c")
    assert post(service.url, body)["remediations"][0]["status"] == "dispatched"
    again = post(service.url, body)
    assert again["remediations"] == [] and again["duplicates"] == 1
    assert post(service.url, group("CoolMe", job_name="job-c"))["remediations"][0]["reason"] == "cooldown"


def approve(url: str, rid: str) -> requests.Response:
    return requests.post(f"{url}/remediations/{rid}/approve", headers=OP_AUTH, json={}, timeout=10)


def test_approval_holds_the_action_until_one_approve_releases_it_to_the_agent(service, r, agents, nvml_lib,
                                                                              nvml_state) -> None:
    agent = agents("gpu-node-1", lib_dir=nvml_lib, state=nvml_state)
    agent.wait_ready(r)
    rem = post(service.url, group("GPUTemperatureHigh", node="gpu-node-1", gpu_id="0"))["remediations"][0]
    assert rem["status"] == "pending_approval"
    rec = requests.get(f"{service.url}/remediations/{rem['id']}").json()
    assert rec["status"] == "pending_approval" and rec["actions"][0]["status"] == "pending"
    assert dispatched_commands(r) == 0 and nvml_state.limit_w(0) == 700

    with ThreadPoolExecutor(8) as pool:
        codes = sorted(pool.map(lambda _: approve(service.url, rem["id"]).status_code, range(8)))
    assert codes == [200] + [409] * 7  # four workers race; exactly one release
    assert dispatched_commands(r) == 1
    assert "fence" not in r.hgetall(keys.record(rem["id"]))
    rec = wait_record(r, rem["id"])
    assert rec["status"] == "applied" and nvml_state.limit_w(0) == 560
    # The release signed its command anew with the fence the record's own fields give (no fence is stored):
    # the agent keeps the fence of what it applied.
    fp = rec["alert"]["fingerprint"]
    applied = json.loads((agent.state_dir / "agent-state.json").read_text())["commands"]
    assert [rem["id"], f"{fp}|2026-11-22T01:25:24Z|hold|0|firing"] in [c[:2] for c in applied]
    again = approve(service.url, rem["id"])
    assert again.status_code == 409 and "not pending approval" in again.json()["error"]


def test_an_approval_not_given_in_time_expires(service, r) -> None:
    rem = post(service.url, group("GPUTemperatureHigh", node="gpu-node-2", gpu_id="0"))["remediations"][0]
    # The reconciler (a thread in each gunicorn worker) ends the hold once its approval time has passed.
    rec = wait_until(lambda: (lambda x: x if x["status"] != "pending_approval" else None)(
        requests.get(f"{service.url}/remediations/{rem['id']}").json()), timeout=20, what="the hold to expire")
    assert rec["status"] == "expired" and rec["reason"] == "approval_expired"
    assert [a["status"] for a in rec["actions"]] == ["expired"]
    late = approve(service.url, rem["id"])
    assert late.status_code == 409 and "expired" in late.json()["error"]
    assert dispatched_commands(r) == 0
    listed = requests.get(service.url + "/history", params={"status": "expired"}).json()["items"]
    assert [x["id"] for x in listed] == [rem["id"]]


def test_an_alert_that_resolves_before_approval_cancels_the_hold_and_undoes_nothing(service, r) -> None:
    fp = "00000000000a9901"
    rem = post(service.url, group("GPUTemperatureHigh", node="gpu-node-4", gpu_id="0", fingerprint=fp))
    rid = rem["remediations"][0]["id"]
    resolved = post(service.url, group("GPUTemperatureHigh", "resolved", fp, node="gpu-node-4", gpu_id="0"))
    assert resolved["remediations"] == []  # no restore for a throttle that never ran
    rec = requests.get(f"{service.url}/remediations/{rid}").json()
    assert (rec["status"], rec["reason"]) == ("expired", "resolved_before_approval")
    late = approve(service.url, rid)
    assert late.status_code == 409  # approving now would throttle a GPU that nothing will restore
    assert dispatched_commands(r) == 0


def test_an_approved_action_is_undone_when_its_alert_resolves(service, r) -> None:
    fp = "00000000000a9902"
    rid = post(service.url, group("GPUTemperatureHigh", node="gpu-node-5", gpu_id="0",
                                  fingerprint=fp))["remediations"][0]["id"]
    assert approve(service.url, rid).status_code == 200
    resolved = post(service.url, group("GPUTemperatureHigh", "resolved", fp, node="gpu-node-5", gpu_id="0"))
    assert [x["status"] for x in resolved["remediations"]] == ["dispatched"]
    assert dispatched_commands(r) == 2


def test_approving_unknown_or_unheld_records_is_404_or_409(service, r) -> None:
    assert approve(service.url, "01ARZ3NDEKTSV4RRFFQ69G5FAV~job~nope").status_code == 404
    assert approve(service.url, "not-an-id").status_code == 404
    rem = post(service.url, group("CoolMe", job_name="job-d"))["remediations"][0]
    assert approve(service.url, rem["id"]).status_code == 409
    assert requests.post(f"{service.url}/remediations/{rem['id']}/approve", timeout=10).status_code == 401


def test_a_dry_run_playbook_records_what_it_would_do_and_dispatches_nothing(service, r) -> None:
    rem = post(service.url, group("DryMe", fingerprint="00000000000d2101"))["remediations"][0]
    assert rem["status"] == "dry_run"
    rec = requests.get(f"{service.url}/remediations/{rem['id']}").json()
    assert [(a["action"], a["params"]) for a in rec["actions"]] == [("scale_lr", {"factor": 0.5}),
                                                                  ("save_checkpoint", {})]
    resolved = post(service.url, group("DryMe", "resolved", "00000000000d2101"))
    assert [x["status"] for x in resolved["remediations"]] == ["dry_run"]
    assert dispatched_commands(r) == 0


def test_a_global_dry_run_dispatches_nothing_for_any_playbook(gunicorn, r) -> None:
    svc = gunicorn(workers=4, TRAINMEDIC_DRY_RUN="1")  # the shipped playbooks
    bodies = [group(name, node="gpu-node-1", gpu_id="0", severity="critical")
              for name in ("GPUTemperatureHigh", "GPUMemoryUsageHigh", "TrainingLossSpike", "DiskSpaceLow")
              for _ in range(5)]
    rems = storm(svc.url, bodies)
    assert len(rems) == 20 and {x["status"] for x in rems} == {"dry_run"}
    assert dispatched_commands(r) == 0
    # A dry run consumes no cooldown: the same alert on the same target is still a dry run, not skipped.
    assert post(svc.url, group("TrainingLossSpike", severity="critical"))["remediations"][0]["status"] == "dry_run"
