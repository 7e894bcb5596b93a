"""End to end: a node's third failure incident within 7 days makes it a lemon. The service runs under gunicorn
with several workers; a real Prometheus scrapes its trainmedic_node_incidents_total and evaluates the shipped
config/rules/trainmedic.yml (unchanged); a real Alertmanager sends NodeLemon to the webhook, where the shipped
lemon-node playbook holds the node's drain for a person."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import requests

from trainmedic.client.receiver.mailbox import Mailbox
from trainmedic.client.wire import keys

from tests.conftest import AUTH, OP_AUTH, ROOT, TOKEN
from tests.support.stack import Alertmanager, Prometheus

from .test_alertmanager import wait_for
from .test_prometheus_rule_e2e import query

NODE = "lemon-01"


def xid(n: int) -> dict:
    """An XID error of GPU n on NODE (a new alert each: its own fingerprint)."""
    alert = {"status": "firing", "labels": {"alertname": "GPUXidError", "node": NODE, "gpu_id": str(n),
                                            "xid_class": "drain", "severity": "critical"},
             "annotations": {}, "startsAt": f"2026-11-22T0{n}:00:00Z", "fingerprint": f"{n:016x}"}
    return {"version": "4", "status": "firing", "alerts": [alert]}


def test_a_nodes_third_failure_incident_raises_node_lemon_and_its_drain_waits_for_a_person(
        gunicorn: Any, r: Any, tmp_path: Path) -> None:
    # The shipped playbooks, but XID errors of one node not held apart by gpu-xid-error's hour of cooldown, so
    # that three arrive within the test.
    playbooks = tmp_path / "playbooks"
    playbooks.mkdir()
    shipped = (ROOT / "playbooks" / "default.yaml").read_text()
    xid_block = shipped.split("  - name: gpu-xid-error\n")[1].split("  - name:")[0]
    quick = shipped.replace(xid_block, xid_block.replace("    cooldown: 1h\n", "    cooldown: 0s\n"))
    assert quick != shipped
    (playbooks / "default.yaml").write_text(quick)
    server = gunicorn(workers=3, TRAINMEDIC_PLAYBOOKS=str(playbooks))
    am = Alertmanager(tmp_path, server.url + "/webhook", TOKEN)
    prom = Prometheus(tmp_path, [server.url.removeprefix("http://")], [ROOT / "config" / "rules" / "trainmedic.yml"],
                      am.url.removeprefix("http://"))
    series = f'trainmedic_node_incidents_total{{node="{NODE}",playbook="gpu-xid-error"}}'

    def count() -> float | None:
        rows = query(prom, series)
        return float(rows[0]["value"][1]) if rows else None

    def lemons() -> list[dict]:
        return [a for a in prom.alerts() if a["labels"].get("alertname") == "NodeLemon"]

    try:
        # The node's agent checks in: its series exist at 0 before its first incident.
        Mailbox(r, keys.Target("node", NODE)).heartbeat({"host": NODE, "pid": 1}, announce=True)
        wait_for(lambda: count() == 0, 30, "the node's series at 0 in Prometheus")
        for n in range(3):
            resp = requests.post(server.url + "/webhook", json=xid(n), headers=AUTH, timeout=10)
            [held] = resp.json()["remediations"]
            assert (held["playbook"], held["status"]) == ("gpu-xid-error", "pending_approval")
            approved = requests.post(f"{server.url}/remediations/{held['id']}/approve", json={}, headers=OP_AUTH,
                                     timeout=10)
            assert approved.status_code == 200, approved.text
            wait_for(lambda n=n: count() == n + 1, 30, f"incident {n + 1} in Prometheus")
            if n < 2:
                assert lemons() == []  # two incidents are no lemon
        alert = wait_for(lambda: next((a for a in lemons() if a["state"] == "firing"), None), 30,
                         "NodeLemon firing in Prometheus")
        assert alert["labels"]["node"] == NODE and float(alert["value"]) >= 3

        def held_lemon() -> dict | None:
            items = requests.get(server.url + "/history", params={"playbook": "lemon-node"}, timeout=10).json()
            return next(iter(items["items"]), None)

        rec = wait_for(held_lemon, 60, "Alertmanager's NodeLemon decided by the service")
    finally:
        prom.stop()
        am.stop()
    assert rec["target"] == {"kind": "node", "name": NODE}
    assert rec["status"] == "pending_approval"  # a person decides; nothing resumes it afterwards
    assert [a["action"] for a in rec["actions"]] == ["drain_node"]
    assert rec["actions"][0]["params"] == {"reason": "lemon"}
    assert rec["alert"]["labels"]["alertname"] == "NodeLemon"
