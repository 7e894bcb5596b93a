"""The breaker: a playbook's max_active bounds the targets with an open remediation of it, across workers.

Real processes: the service under gunicorn with 4 workers (each with its reconciler), Redis, and 10 node agents
on the NVML stand-in. Ten alerts arrive at once, one request each, so the workers decide them concurrently.
"""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import redis
import requests

from trainmedic.client.wire import keys

from tests.conftest import AUTH, load_fixture, write_playbooks
from tests.support.jobs import wait_record, wait_until
from tests.support.nvml import FakeGpu, NvmlState
from tests.support.receiver import Receiver

PLAYBOOKS = """\
playbooks:
  - name: hot
    matchers: ['alertname="GPUHot"']
    target: node
    actions: [{power_limit: {fraction: 0.8}}]
    on_resolved: [{restore_power_limit: {}}]
    max_active: {percent: 20}
    notify: %s
"""


def alert(node: str, fingerprint: str, status: str = "firing") -> dict:
    body = load_fixture("firing_single.json")
    body["status"] = status
    body["alerts"][0].update(fingerprint=fingerprint, status=status)
    if status == "resolved":
        body["alerts"][0]["endsAt"] = "2030-01-01T00:00:00Z"
    body["alerts"][0]["labels"] = {"alertname": "GPUHot", "node": node, "gpu_id": "0"}
    return body


def post(url: str, body: dict) -> dict:
    resp = requests.post(url + "/webhook", data=json.dumps(body), headers={**AUTH, "Content-Type": "application/json"},
                         timeout=30)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def test_ten_alerts_at_once_through_four_workers_dispatch_exactly_the_bound(
        gunicorn: Any, agents: Any, nvml_lib: Path, r: redis.Redis, tmp_path: Path) -> None:
    hook = Receiver()
    nodes = [f"gpu-node-{i:02d}" for i in range(10)]
    procs = []
    for node in nodes:
        state = NvmlState(tmp_path / f"nvml-{node}.txt")
        state.write([FakeGpu(0, f"GPU-{node}-0000-1111-2222-333344445555")])
        procs.append(agents(node, lib_dir=nvml_lib, state=state, args=["--scheduler", "none"]))
    for p in procs:
        p.wait_ready(r, timeout=60)
    svc = gunicorn(4, TRAINMEDIC_PLAYBOOKS=str(write_playbooks(tmp_path / "p.yaml", PLAYBOOKS % hook.url)))
    # The percent counts the nodes the service saw heartbeat: the agents started first, so it learns of them at
    # their next heartbeat (within 5 s).
    wait_until(lambda: r.zcount(keys.live("node"), f"({int(time.time() * 1000)}", "+inf") == 10, 30,
               what="the service to see the ten nodes heartbeat")

    with ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(lambda i: post(svc.url, alert(nodes[i], f"hot{i}")), range(10)))
    made = [a["remediations"][0] for a in answers]
    dispatched = [m for m in made if m["status"] == "dispatched"]
    refused = [m for m in made if m["status"] == "skipped"]
    assert len(dispatched) == 2, made
    assert len(refused) == 8 and {m["reason"] for m in refused} == {"breaker_open"}, made

    # One notification when it opened; the gauge and GET /playbooks say it is open.
    texts = hook.wait(1, timeout=20)
    time.sleep(2.0)
    assert len(hook.texts()) == 1 and "breaker opened" in texts[0], hook.texts()
    scrape = requests.get(svc.url + "/metrics", timeout=10).text
    assert 'trainmedic_breaker_open{playbook="hot"} 1.0' in scrape
    [pb] = requests.get(svc.url + "/playbooks", timeout=10).json()["items"]
    assert pb["settings"]["max_active"] == {"percent": 20}
    assert pb["breaker"] == {"limit": 2, "active": 2, "open": True}
    assert "breaker open" in requests.get(svc.url + "/", timeout=10).text

    # Both dispatched throttles are applied by their agents; one alert resolves, and a new alert goes out.
    for m in dispatched:
        wait_record(r, m["id"], lambda rec: rec is not None and rec["status"] == "applied", timeout=30)
    first = next(i for i, m in enumerate(made) if m["id"] == dispatched[0]["id"])
    post(svc.url, alert(nodes[first], f"hot{first}", status="resolved"))
    deadline = time.monotonic() + 30
    while r.exists(keys.breaker_state("hot")) or len(r.zrange(keys.breaker_open("hot"), 0, -1)) > 1:
        assert time.monotonic() < deadline, "the resolve did not free a place"
        time.sleep(0.2)
    waiting = next(i for i, m in enumerate(made) if m["status"] == "skipped")
    [again] = post(svc.url, alert(nodes[waiting], f"hot{waiting}later"))["remediations"]
    assert again["status"] == "dispatched", again
    # A node without an open remediation of the playbook (one that holds a place would be let through).
    other = next(i for i, m in enumerate(made) if m["status"] == "skipped" and i != waiting)
    [more] = post(svc.url, alert(nodes[other], "hotonemore"))["remediations"]
    assert (more["status"], more["reason"]) == ("skipped", "breaker_open"), more
    hook.close()
