"""GET /metrics with 10,000 targets holding commands (and some live): scrape time p50/p99.

Run: .venv/bin/python benchmarks/metrics_scale.py [--targets 10000] [--live 2000] [--scrapes 50]
gunicorn (4 workers) on an embedded Redis (AOF fsync always); the targets are filled through the webhook
(500-alert bodies, one new job per alert: each gets a dispatched command), and --live of them heartbeat.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import requests
from common import ROOT, TOKEN, Stack, percentile

import redis

from trainmedic.client.wire import keys
from trainmedic.client.receiver.mailbox import Mailbox


def body(start: int, n: int) -> dict:
    alerts = [{"status": "firing", "labels": {"alertname": "TrainingLossSpike", "job_name": f"scale-{i}",
                                              "severity": "critical", "instance": f"gpu-node-{i % 500}:9445"},
               "annotations": {"summary": "Training loss spike detected"},
               "startsAt": "2026-11-22T01:25:24.115697517Z", "endsAt": "0001-01-01T00:00:00Z",
               "generatorURL": "", "fingerprint": f"{i:016x}"} for i in range(start, start + n)]
    return {"receiver": "trainmedic", "status": "firing", "alerts": alerts, "version": "4",
            "groupKey": "{}:{}", "externalURL": "http://am:9093"}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", type=int, default=10_000)
    ap.add_argument("--live", type=int, default=2_000)
    ap.add_argument("--scrapes", type=int, default=50)
    args = ap.parse_args()
    with Stack(workers=4, playbooks=str(ROOT / "benchmarks" / "playbooks.yaml")) as stack:
        s = requests.Session()
        hdr = {"Authorization": f"Bearer {TOKEN}"}
        t0 = time.monotonic()
        for start in range(0, args.targets, 500):
            s.post(stack.url + "/webhook", json=body(start, min(500, args.targets - start)), headers=hdr,
                   timeout=60).raise_for_status()
        fill = time.monotonic() - t0
        r = redis.Redis.from_url(stack.redis_url, decode_responses=True)
        for i in range(args.live):
            Mailbox(r, keys.Target("job", f"scale-{i}")).heartbeat({"host": "bench", "pid": i}, ttl=600)
        times = []
        text = ""
        for _ in range(args.scrapes):
            t = time.perf_counter()
            resp = s.get(stack.url + "/metrics", timeout=60)
            times.append((time.perf_counter() - t) * 1000)
            resp.raise_for_status()
            text = resp.text
        backlog = [ln for ln in text.splitlines() if ln.startswith(("trainmedic_mailbox_backlog{",
                                                                      "trainmedic_targets_live{"))]
    p50, p99 = percentile(times, 50), percentile(times, 99)
    print(f"GET /metrics, gunicorn 4 workers, {os.cpu_count()} cores; {args.targets} targets holding a command "
          f"(filled in {fill:.1f}s), {args.live} live")
    print(f"{'targets':>8} {'live':>6} {'scrapes':>8} {'p50 ms':>8} {'p99 ms':>8}")
    print(f"{args.targets:>8} {args.live:>6} {args.scrapes:>8} {p50:>8.1f} {p99:>8.1f}")
    print("  " + "  ".join(backlog))
    (ROOT / "benchmarks" / "results").mkdir(exist_ok=True)
    (ROOT / "benchmarks" / "results" / "metrics_scale.json").write_text(json.dumps(
        {"targets": args.targets, "live": args.live, "p50_ms": p50, "p99_ms": p99, "samples": backlog}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
