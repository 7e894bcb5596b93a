"""Host action latency: webhook accepted (HTTP 200) -> the node agent's ack written into the record.

Run: .venv/bin/python benchmarks/host_latency.py [--alerts 100]
Gunicorn with 4 workers and an embedded Redis (benchmarks/common.py), one real `trainmedic agent`
subprocess whose NVML is the C stand-in of tests/support/nvml (compiled here with cc), so every action goes
through real pynvml calls into a library that reads and writes its state file. Alerts are sent one at a
time, each a new GPUTemperatureHigh episode (power_limit), then each is resolved (restore_power_limit).
The ack is observed by polling the record's action status in Redis every 0.25 ms.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis
import requests

from common import ROOT, TOKEN, Stack, percentile

from trainmedic.client.wire import keys
from tests.support.nvml import FakeGpu, NvmlState, build

NODE = "bench-node"


def body(i: int, status: str) -> dict:
    return {"version": "4", "status": status, "receiver": "trainmedic", "alerts": [{
        "status": status, "labels": {"alertname": "GPUTemperatureHigh", "node": NODE, "gpu_id": str(i % 8)},
        "annotations": {}, "startsAt": "2026-11-22T01:25:24Z", "fingerprint": f"host{i:012x}"}]}


def wait_ack(r: redis.Redis, rid: str, timeout: float = 10.0) -> float:
    """time.perf_counter() when the record's first action is no longer pending/delivered."""
    key = keys.record(rid)
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        if r.hget(key, "a:0:status") not in ("pending", "delivered"):
            return time.perf_counter()
        time.sleep(0.00025)
    raise RuntimeError(f"no ack for {rid} within {timeout}s")


def send(stack: Stack, i: int, status: str, r: redis.Redis, s: requests.Session) -> tuple[float, float]:
    """(accepted -> ack ms, POST -> 200 ms) for one alert; its action must be applied."""
    t0 = time.perf_counter()
    resp = s.post(stack.url + "/webhook", json=body(i, status), headers={"Authorization": f"Bearer {TOKEN}"})
    accepted = time.perf_counter()
    rems = resp.json()["remediations"]
    assert resp.status_code == 200 and rems and rems[0]["status"] == "dispatched", resp.text
    done = wait_ack(r, rems[0]["id"])
    rec = r.hgetall(keys.record(rems[0]["id"]))
    assert rec["a:0:status"] == "applied", rec
    return (done - accepted) * 1000, (accepted - t0) * 1000


def run(stack: Stack, first: int, n: int, r: redis.Redis, s: requests.Session) -> dict[str, list[float]]:
    """n episodes, each fired (power_limit) then resolved (restore_power_limit) before the next."""
    out: dict[str, list[float]] = {"firing": [], "resolved": [], "http": []}
    for i in range(first, first + n):
        for status in ("firing", "resolved"):
            ack, http = send(stack, i, status, r, s)
            out[status].append(ack)
            out["http"].append(http)
    return out


def row(name: str, values: list[float]) -> str:
    return (f"{name:<31} {len(values):>4} {percentile(values, 50):>8.2f} {percentile(values, 90):>8.2f} "
            f"{percentile(values, 99):>8.2f} {max(values):>8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--alerts", type=int, default=100)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="trainmedic-host-bench-"))
    lib_dir = build(tmp / "nvml").parent
    state = NvmlState(tmp / "nvml-state.txt")
    state.write([FakeGpu(i, f"GPU-{i:08x}-0000-0000-0000-000000000000") for i in range(8)])
    with Stack(workers=4, playbooks=str(ROOT / "benchmarks" / "playbooks.yaml")) as stack:
        r = redis.Redis.from_url(stack.redis_url, decode_responses=True)
        env = dict(os.environ, LD_LIBRARY_PATH=str(lib_dir), NVML_STUB_STATE=str(state.path),
                   TRAINMEDIC_LOG_LEVEL="warning")
        log = open(tmp / "agent.log", "wb")
        cli = [sys.executable, "-m", "trainmedic.service.cli"]
        agent = subprocess.Popen([*cli, "agent", "--node", NODE, "--redis-url", stack.redis_url], env=env, cwd=ROOT,
                                 stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 30
            while not r.exists(keys.heartbeat(keys.Target("node", NODE))):
                assert time.monotonic() < deadline and agent.poll() is None, (tmp / "agent.log").read_text()
                time.sleep(0.05)
            s = requests.Session()
            run(stack, 10_000, 5, r, s)  # warm-up: connections, script cache, imports; not reported
            got = run(stack, 0, args.alerts, r, s)
            throttle, restore, http = got["firing"], got["resolved"], got["http"]
            assert {g.current_mw for g in state.gpus().values()} == {700_000}, "restores did not put limits back"
        finally:
            agent.terminate()
            agent.wait(15)
            log.close()
            r.close()
    print(f"host action latency: webhook 200 -> agent ack in the record ({args.alerts} alerts each; gunicorn 4 "
          f"workers, 1 agent, pynvml -> C NVML stand-in; {os.cpu_count()} CPUs)")
    print(f"{'path':<31} {'n':>4} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    print(row("power_limit (firing)", throttle))
    print(row("restore_power_limit (resolved)", restore))
    print(row("webhook POST -> 200", http))
    out = {"n": args.alerts,
           "power_limit_p50_ms": percentile(throttle, 50), "power_limit_p99_ms": percentile(throttle, 99),
           "restore_p50_ms": percentile(restore, 50), "restore_p99_ms": percentile(restore, 99),
           "webhook_p50_ms": percentile(http, 50),
           "webhook_p99_ms": percentile(http, 99)}
    (ROOT / "benchmarks" / "results").mkdir(exist_ok=True)
    (ROOT / "benchmarks" / "results" / "host_latency.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
