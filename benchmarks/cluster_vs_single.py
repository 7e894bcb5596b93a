"""Webhook throughput on a real 3-master Redis Cluster vs a single Redis, in the same run.

Run: .venv/bin/python benchmarks/cluster_vs_single.py [--seconds 10]
Same load as webhook_throughput.py (wrk, 8 connections, unique alerts, gunicorn 4 workers); the cluster is
three redis-server processes on this machine, made with redis-cli --cluster create.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from common import ROOT, Stack
from webhook_throughput import run_wrk

from trainmedic.service.embedded_redis import EmbeddedRedis
from tests.support.redis_cluster import EmbeddedCluster


def measure(url: str, seconds: int) -> list[dict]:
    rows = []
    with Stack(workers=4, redis_url=url, playbooks=str(ROOT / "benchmarks" / "playbooks.yaml")) as stack:
        for group in (1, 10):
            run_wrk(stack.url, group, 2)  # warm-up
            rows.append(run_wrk(stack.url, group, seconds))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=10)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="trainmedic-bench-"))
    results = {}
    with EmbeddedRedis(tmp / "single") as single:
        results["single Redis"] = measure(single.url, args.seconds)
    with EmbeddedCluster(tmp / "cluster") as cluster:
        results["Redis Cluster (3 masters)"] = measure(cluster.url, args.seconds)
    print(f"webhook throughput, gunicorn 4 workers, 8 connections, unique alerts, {args.seconds}s per run, "
          "everything on one 2-core machine")
    print(f"{'redis':<27} {'alerts/req':>10} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} {'non-2xx':>8}")
    for name, rows in results.items():
        for row in rows:
            print(f"{name:<27} {row['group']:>10} {row['rps']:>7.0f} {row['p50_ms']:>7.1f} {row['p99_ms']:>7.1f} "
                  f"{row['non2xx'] + row['errors']:>8}")
    (ROOT / "benchmarks" / "results" / "cluster_vs_single.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
