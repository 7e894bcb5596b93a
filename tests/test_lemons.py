"""Lemon nodes: trainmedic_node_incidents_total counts the firing remediations dispatched to each node, kept in
Redis by the scripts that dispatch them (on a single Redis and on a Redis Cluster), with series at 0 from the
first time the service sees a node; GET /targets and the history page show each node's incidents of 7 days."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import redis

from trainmedic.client.receiver.mailbox import Mailbox
from trainmedic.client.wire import keys
from trainmedic.service import lemons

from tests.conftest import ROOT, post_json, write_playbooks
from tests.support.keyspaces import BOTH
from tests.test_metrics import samples

INCIDENTS = "trainmedic_node_incidents_total"
# The shipped playbooks that act on nodes, lemon-node's own left out: a node seen has a series of each.
COUNTED = {"gpu-temperature-high", "gpu-xid-error", "disk-space-low", "straggler"}


def alert(name: str, node: str, fingerprint: str, status: str = "firing", **labels: str) -> dict:
    return {"status": status, "labels": {"alertname": name, "node": node, "severity": "critical", **labels},
            "annotations": {}, "startsAt": "2026-11-22T03:00:00Z",
            "endsAt": "0001-01-01T00:00:00Z" if status == "firing" else "2026-11-22T03:20:00Z",
            "generatorURL": "", "fingerprint": fingerprint}


def notify(*alerts: dict) -> dict:
    return {"version": "4", "status": alerts[0]["status"], "receiver": "trainmedic", "groupKey": "{}:{}",
            "truncatedAlerts": 0, "groupLabels": {}, "commonLabels": {}, "commonAnnotations": {},
            "externalURL": "http://alertmanager:9093", "alerts": list(alerts)}


def post(http: Any, *alerts: dict) -> list[dict]:
    resp = post_json(http, "/webhook", notify(*alerts))
    assert resp.status_code == 200, resp.get_json()
    return resp.get_json()["remediations"]


def incidents(http: Any) -> dict[tuple[str, str], float]:
    """(node, playbook) -> trainmedic_node_incidents_total, for the series the scrape has."""
    return {(dict(labels)["node"], dict(labels)["playbook"]): v
            for (name, labels), v in samples(http.get("/metrics").get_data(as_text=True)).items() if name == INCIDENTS}


def of(http: Any, node: str) -> dict[str, float]:
    return {pb: v for (n, pb), v in incidents(http).items() if n == node}


def live_node(r: Any, node: str) -> None:
    Mailbox(r, keys.Target("node", node)).heartbeat(
        {"host": "h", "pid": 1, "actions": ["power_limit", "restore_power_limit", "disk_cleanup"]}, announce=True)


def listed(http: Any, node: str) -> dict:
    """The node as GET /targets lists it, once the service has heard its heartbeat."""
    return wait(lambda: next((t for t in http.get("/targets").get_json()["targets"] if t["name"] == node), None),
                f"{node} listed")


def wait(cond: Any, what: str, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"waited {timeout:.0f}s for {what}"
        time.sleep(0.02)


@BOTH
def test_a_firing_remediation_dispatched_to_a_node_counts_once_and_its_resolve_not_at_all(http: Any, r: Any) -> None:
    hot = alert("GPUTemperatureHigh", "gpu-a1", "00000000000000a1", gpu_id="0")
    [m] = post(http, hot)
    assert (m["status"], m["reason"]) == ("dispatched", "no_live_target")  # no agent: counted all the same
    assert post(http, hot) == []  # Alertmanager's resend of the same episode
    assert of(http, "gpu-a1") == {**dict.fromkeys(COUNTED, 0.0), "gpu-temperature-high": 1.0}
    # The node's other GPU within the playbook's cooldown: skipped, no incident.
    [skip] = post(http, alert("GPUTemperatureHigh", "gpu-a1", "00000000000000a2", gpu_id="1"))
    assert (skip["status"], skip["reason"]) == ("skipped", "cooldown")
    # The resolve's on_resolved record (the power limit put back) is no incident either.
    [undo] = post(http, alert("GPUTemperatureHigh", "gpu-a1", "00000000000000a1", "resolved", gpu_id="0"))
    assert undo["status"] == "dispatched"
    assert of(http, "gpu-a1")["gpu-temperature-high"] == 1.0
    # A job's remediations are no node's.
    post(http, {**alert("TrainingLossSpike", "gpu-a1", "00000000000000a3"),
                "labels": {"alertname": "TrainingLossSpike", "job_name": "llama", "severity": "critical"}})
    assert {n for n, _ in incidents(http)} == {"gpu-a1"}


def test_a_node_seen_through_its_agent_has_its_series_at_zero_before_its_first_incident(http: Any, r: Any) -> None:
    live_node(r, "gpu-b1")
    got = wait(lambda: of(http, "gpu-b1"), "the node's series")
    assert got == dict.fromkeys(COUNTED, 0.0)  # lemon-node's own drains are never counted: no series
    assert listed(http, "gpu-b1")["incidents_7d"] == 0
    [m] = post(http, alert("DiskSpaceLow", "gpu-b1", "00000000000000b1", mountpoint="/data"))
    assert (m["status"], m["reason"]) == ("dispatched", None)
    assert of(http, "gpu-b1")["disk-space-low"] == 1.0
    assert listed(http, "gpu-b1")["incidents_7d"] == 1


@BOTH
def test_a_held_remediation_counts_once_a_person_approves_it_and_a_rejected_one_never(http: Any, r: Any) -> None:
    [xid] = post(http, alert("GPUXidError", "gpu-c1", "00000000000000c1", xid_class="drain"))
    [slow] = post(http, {**alert("TrainingStraggler", "gpu-c2", "00000000000000c2"),
                         "labels": {"alertname": "TrainingStraggler", "job_name": "llama", "node": "gpu-c2",
                                    "rank": "3", "severity": "warning", "source": "trainmedic"}})
    assert xid["status"] == slow["status"] == "pending_approval"
    assert incidents(http) == {}  # neither node was seen yet, and a hold is no incident
    assert post_json(http, f"/remediations/{xid['id']}/approve", {}).status_code == 200
    assert post_json(http, f"/remediations/{slow['id']}/reject", {}).status_code == 200
    assert of(http, "gpu-c1") == {**dict.fromkeys(COUNTED, 0.0), "gpu-xid-error": 1.0}
    assert of(http, "gpu-c2") == {}
    # Approving it again changes nothing.
    assert post_json(http, f"/remediations/{xid['id']}/approve", {}).status_code == 409
    assert of(http, "gpu-c1")["gpu-xid-error"] == 1.0


def test_the_lemon_node_playbooks_own_drains_and_dry_runs_are_no_incidents(make_app: Any, r: Any,
                                                                            tmp_path: Path) -> None:
    shipped = (ROOT / "playbooks" / "default.yaml").read_text()
    dry = shipped.replace("    cooldown: 30m\n", "    cooldown: 30m\n    dry_run: true\n", 1)
    assert dry != shipped and "dry_run: true" in dry.split("name: disk-space-low")[1].split("- name:")[0]
    http = make_app(playbooks=str(write_playbooks(tmp_path / "pb.yaml", dry))).test_client()
    live_node(r, "gpu-d1")
    wait(lambda: of(http, "gpu-d1"), "the node's series")
    [lemon] = post(http, alert("NodeLemon", "gpu-d1", "00000000000000d1"))
    assert (lemon["playbook"], lemon["status"]) == ("lemon-node", "pending_approval")
    assert post_json(http, f"/remediations/{lemon['id']}/approve", {}).status_code == 200
    [dry_run] = post(http, alert("DiskSpaceLow", "gpu-d1", "00000000000000d2", mountpoint="/data"))
    assert dry_run["status"] == "dry_run"
    assert of(http, "gpu-d1") == dict.fromkeys(COUNTED, 0.0)


def test_a_node_counts_its_incidents_of_the_last_7_days_only(http: Any, r: redis.Redis) -> None:
    live_node(r, "gpu-e1")
    node = keys.Target("node", "gpu-e1")
    # An incident of 8 days ago, as the scripts keep one (a record id and when it was dispatched).
    old = f"01J{0:023d}~node~gpu-e1"
    r.zadd(keys.node_incident_times(node), {old: int((time.time() - 8 * 86400) * 1000)})
    r.hset(keys.node_incidents(node), "gpu-temperature-high", 1)
    assert lemons.recent(r, ["gpu-e1"]) == {"gpu-e1": 0}
    post(http, alert("GPUTemperatureHigh", "gpu-e1", "00000000000000e1", gpu_id="0"))
    post(http, alert("DiskSpaceLow", "gpu-e1", "00000000000000e2", mountpoint="/data"))
    assert listed(http, "gpu-e1")["incidents_7d"] == 2
    assert of(http, "gpu-e1")["gpu-temperature-high"] == 2.0  # the counter keeps them all
    assert old not in r.zrange(keys.node_incident_times(node), 0, -1)  # the script trimmed the old one
    page = http.get("/").get_data(as_text=True)
    assert "2 incidents in 7 days" in page


def test_an_agent_cannot_name_its_own_incident_count(http: Any, r: Any) -> None:
    Mailbox(r, keys.Target("node", "gpu-f1")).heartbeat({"host": "h", "incidents_7d": 99}, announce=True)
    assert listed(http, "gpu-f1")["incidents_7d"] == 0


def test_counts_that_are_not_counts_are_left_out_and_repaired(http: Any, r: redis.Redis) -> None:
    live_node(r, "gpu-g1")
    wait(lambda: of(http, "gpu-g1"), "the node's series")
    node = keys.Target("node", "gpu-g1")
    r.hset(keys.node_incidents(node), mapping={"gpu-temperature-high": "lots", "straggler": 2})
    got = of(http, "gpu-g1")
    assert got["straggler"] == 2.0 and got["gpu-temperature-high"] == 0.0
    # The next incident there puts the count right and counts.
    [m] = post(http, alert("GPUTemperatureHigh", "gpu-g1", "00000000000000g1", gpu_id="0"))
    assert m["status"] == "dispatched"
    assert of(http, "gpu-g1")["gpu-temperature-high"] == 1.0
    r.delete(keys.node_incident_times(node))
    r.set(keys.node_incident_times(node), "not a sorted set")
    assert listed(http, "gpu-g1")["incidents_7d"] == 0


def test_every_gunicorn_worker_shows_the_same_counts(gunicorn: Any, r: redis.Redis) -> None:
    import requests

    from tests.conftest import AUTH

    server = gunicorn(workers=3)
    for i in range(3):
        body = notify(alert("DiskSpaceLow", f"gpu-h{i}", f"00000000000000h{i}", mountpoint="/data"))
        assert requests.post(server.url + "/webhook", json=body, headers=AUTH, timeout=10).ok
    scrapes = [samples(requests.get(server.url + "/metrics", timeout=10).text) for _ in range(9)]
    for s in scrapes:
        got = {dict(labels)["node"]: v for (name, labels), v in s.items()
               if name == INCIDENTS and dict(labels)["playbook"] == "disk-space-low"}
        assert got == {"gpu-h0": 1.0, "gpu-h1": 1.0, "gpu-h2": 1.0}

