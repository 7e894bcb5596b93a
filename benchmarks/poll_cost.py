"""Idle RemediationClient.poll() cost, against one Redis round trip and a 10 ms training step.

Run: .venv/bin/python benchmarks/poll_cost.py [--calls 1000000]
The client runs as in training: its receive/heartbeat and ack threads are live on an embedded Redis
(as the test fixture starts it). One process, no torch.distributed: the collective is collective_cost.py.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402
import torch  # noqa: E402

from trainmedic.client import RemediationClient
from trainmedic.client.wire import keys
from trainmedic.client.receiver.mailbox import Entry
from trainmedic.client.wire.protocol import ActionCall, Command
from trainmedic.service.embedded_redis import EmbeddedRedis

STEP_NS = 10_000_000  # a 10 ms training step


def per_call_ns(fn, calls: int, repeats: int = 5) -> float:
    """Best-of-repeats mean ns per call of fn(i) (the best run is the one least disturbed by others)."""
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for i in range(calls):
            fn(i)
        runs.append((time.perf_counter_ns() - t0) / calls)
    return min(runs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=1_000_000)
    ap.add_argument("--pings", type=int, default=20_000)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="trainmedic-poll-"))
    server = EmbeddedRedis(tmp / "redis", appendonly=False).start()
    try:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(4))], lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, 100)
        r = redis.Redis.from_url(server.url, decode_responses=True)
        with RemediationClient(job="bench-poll", redis_url=server.url, optimizer=opt, scheduler=sched,
                               heartbeat_interval=1.0) as rc:
            deadline = time.monotonic() + 10
            while not r.exists(keys.heartbeat(keys.Target("job", "bench-poll"))) and time.monotonic() < deadline:
                time.sleep(0.01)
            poll = rc.poll
            idle = per_call_ns(lambda i: poll(step=i), args.calls)
            idle_nostep = per_call_ns(lambda i: poll(), args.calls)
            empty = per_call_ns(lambda i: None, args.calls)  # the loop and lambda themselves

            # A poll that applies one scale_lr (factor 1.0 keeps the LR sane over many runs); its ack is queued.
            cmd = Command(f"{'0' * 26}~job~bench-poll", "job", "bench-poll",
                          (ActionCall(0, "scale_lr", {"factor": 1.0}),), time.time(), time.time() + 3600)
            ready = rc._inbox.ready
            applying = []
            for _ in range(2000):
                ready.append(Entry("1-0", cmd))
                t0 = time.perf_counter_ns()
                rc.poll(step=1)
                applying.append(time.perf_counter_ns() - t0)
        ping = per_call_ns(lambda i: r.ping(), args.pings, repeats=3)
        r.close()
    finally:
        server.stop()

    apply_ns = statistics.median(applying)
    print(f"idle poll(step=i): {idle:,.0f} ns/call   (poll(): {idle_nostep:,.0f} ns; bare loop {empty:,.0f} ns)")
    print(f"one Redis round trip (PING, embedded redis-server on loopback): {ping:,.0f} ns")
    print(f"ratio: an idle poll costs 1/{ping / idle:,.0f} of a round trip   goal: idle poll <= 5,000 ns "
          f"({'met' if idle <= 5000 else 'NOT met'})")
    print(f"idle poll as share of a 10 ms step: {100 * idle / STEP_NS:.5f} %")
    print(f"a poll that applies one scale_lr (median of 2000): {apply_ns / 1000:,.1f} us "
          f"= {100 * apply_ns / STEP_NS:.3f} % of a 10 ms step (only on the step a command arrives)")
    out = ROOT / "benchmarks" / "results"
    out.mkdir(exist_ok=True)
    (out / "poll_cost.json").write_text(json.dumps({
        "idle_poll_ns": idle, "idle_poll_nostep_ns": idle_nostep, "loop_overhead_ns": empty, "ping_ns": ping,
        "ping_over_poll": ping / idle, "idle_pct_of_10ms": 100 * idle / STEP_NS, "apply_scale_lr_ns": apply_ns,
    }, indent=1))


if __name__ == "__main__":
    main()
