"""Webhook throughput and latency under gunicorn (4 workers), unique alerts, groups of 1 and 10, 8 connections.

Run: .venv/bin/python benchmarks/webhook_throughput.py [--seconds 10]
Load generator: wrk (Debian) with benchmarks/webhook.lua; every request carries new fingerprints.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from common import ROOT, TOKEN, Stack

import redis

from trainmedic.client.wire import keys
from trainmedic.service import history


def run_wrk(url: str, group: int, seconds: int, connections: int = 8) -> dict:
    env = dict(os.environ, TRAINMEDIC_BENCH_GROUP=str(group), TRAINMEDIC_BENCH_TOKEN=TOKEN)
    out = subprocess.run(["wrk", "-t", "2", "-c", str(connections), "-d", f"{seconds}s", "--latency",
                          "-s", str(ROOT / "benchmarks" / "webhook.lua"), url + "/webhook"],
                         capture_output=True, text=True, env=env, check=True).stdout
    m = re.search(r"RESULT requests=(\d+) duration_us=(\d+) non2xx=(\d+) errors=(\d+) p50_us=(\d+) p99_us=(\d+)", out)
    if not m:
        raise RuntimeError(out)
    req, dur, non2xx, errors, p50, p99 = map(int, m.groups())
    return {"group": group, "connections": connections, "requests": req, "rps": req / (dur / 1e6),
            "alerts_per_s": req * group / (dur / 1e6), "p50_ms": p50 / 1000, "p99_ms": p99 / 1000,
            "non2xx": non2xx, "errors": errors}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--redis-url", help="use this Redis (e.g. a cluster node) instead of an embedded one")
    args = ap.parse_args()
    rows = []
    with Stack(workers=args.workers, redis_url=args.redis_url,
               playbooks=str(ROOT / "benchmarks" / "playbooks.yaml")) as stack:
        for group in (1, 10):
            run_wrk(stack.url, group, 2)  # warm-up
            rows.append(run_wrk(stack.url, group, args.seconds))
        r = redis.Redis.from_url(stack.redis_url)
        history.catch_up(r)  # what a history query does first
        recorded = r.zcard(keys.HISTORY)
        dispatched = sum(r.xlen(k) for k in r.scan_iter(match="trainmedic:*:mailbox"))
    print(f"webhook under gunicorn ({args.workers} workers, gthread), 8 connections, unique alerts, "
          f"{args.seconds}s per run, {os.cpu_count()} cores")
    print(f"{'alerts/req':>10} {'req/s':>8} {'alerts/s':>9} {'p50 ms':>7} {'p99 ms':>7} {'non-2xx':>8}")
    for row in rows:
        print(f"{row['group']:>10} {row['rps']:>8.0f} {row['alerts_per_s']:>9.0f} {row['p50_ms']:>7.1f} "
              f"{row['p99_ms']:>7.1f} {row['non2xx'] + row['errors']:>8}")
    print(f"records written: {recorded}, commands in mailboxes (MAXLEN ~1000 per target): {dispatched}")
    Path(ROOT / "benchmarks" / "results").mkdir(exist_ok=True)
    (ROOT / "benchmarks" / "results" / "webhook_throughput.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    sys.exit(main())
