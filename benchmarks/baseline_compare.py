"""trainmedic against the baseline service (benchmarks/baseline/), side by side in one run, on an alert storm.

Run: .venv/bin/python benchmarks/baseline_compare.py [--seconds 10] [--rounds 3]

Both services run under gunicorn with 4 workers; wrk (Debian) with benchmarks/storm.lua drives 8
connections with two streams: 10-alert groups and 1-alert groups, where every alert has a new fingerprint
AND a new job name, with the labels and annotations Alertmanager 0.25 sends. Only TrainingLossSpike alerts
(the baseline's other handlers run shell commands on the machine). trainmedic runs as in production: the
shipped playbooks, Redis with AOF and appendfsync always, commands signed, the reconciler running in every
worker, logs at info (one JSON line per remediation, to a file). The two are measured one after the other
within each round (never at once: they would share the cores), alternating which goes first; the table
shows the median round.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests
from common import ROOT, TOKEN, Stack

import redis

from trainmedic.client.wire import keys
from trainmedic.service.embedded_redis import free_port
from trainmedic.service import history

# The service trainmedic replaces, kept beside the benchmarks (benchmarks/baseline/README.md says what it is).
PEERS = Path(os.environ.get("TRAINMEDIC_BASELINE_DIR", ROOT / "benchmarks" / "baseline"))
LUA = ROOT / "benchmarks" / "storm.lua"


class Baseline:
    """The baseline's AutoRemediationSystem under gunicorn (its README's command), logs into a temp folder."""

    def __init__(self, workers: int = 4):
        self.tmp = Path(tempfile.mkdtemp(prefix="trainmedic-baseline-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workers = workers

    def __enter__(self) -> Baseline:
        env = dict(os.environ, SEED_LOG=str(self.tmp / "seed.log"), SEED_CMD_FILE=str(self.tmp / "seed-cmd.json"))
        self.log = open(self.tmp / "gunicorn.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "-w", str(self.workers), "-b", f"127.0.0.1:{self.port}",
             "--chdir", str(PEERS), "seed_auto_remediation:app"],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=self.tmp)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if requests.get(self.url + "/health", timeout=1).ok:
                    return self
            except requests.RequestException:
                time.sleep(0.1)
        raise RuntimeError(f"baseline did not start; see {self.tmp / 'gunicorn.log'}")

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(15)
        self.log.close()


_run = 0


def wrk(url: str, group: int, seconds: int, connections: int = 8) -> dict:
    """One wrk run of the storm stream; a new run tag, so no fingerprint or job name repeats."""
    global _run
    _run += 1
    env = dict(os.environ, TRAINMEDIC_BENCH_GROUP=str(group), TRAINMEDIC_BENCH_TOKEN=TOKEN,
               TRAINMEDIC_BENCH_RUN=str(_run))
    out = subprocess.run(["wrk", "-t", "2", "-c", str(connections), "-d", f"{seconds}s", "--latency",
                          "-s", str(LUA), url + "/webhook"], capture_output=True, text=True, env=env,
                         check=True).stdout
    m = re.search(r"RESULT requests=(\d+) duration_us=(\d+) non2xx=(\d+) errors=(\d+) p50_us=(\d+) p99_us=(\d+)", out)
    if not m:
        raise RuntimeError(out)
    req, dur, non2xx, errors, p50, p99 = map(int, m.groups())
    return {"requests": req, "rps": req / (dur / 1e6), "p50_ms": p50 / 1000, "p99_ms": p99 / 1000,
            "non2xx": non2xx + errors}


def median_row(runs: list[dict]) -> dict:
    """The round with the median req/s (its latencies with it), and every round's errors summed."""
    mid = sorted(runs, key=lambda r: r["rps"])[len(runs) // 2]
    return {**mid, "non2xx": sum(r["non2xx"] for r in runs), "all_rps": [round(r["rps"]) for r in runs]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--fsync", choices=("everysec", "always"), default="everysec",
                    help="Redis's appendfsync (everysec: trainmedic's default)")
    ap.add_argument("--playbooks", default=str(ROOT / "playbooks"), help="trainmedic's playbooks (default: shipped)")
    args = ap.parse_args()
    results: dict[int, dict[str, list[dict]]] = {}
    sent = 0
    # Log level info, as `trainmedic serve` runs by default (the baseline logs at INFO too).
    stack_env = {"TRAINMEDIC_LOG_LEVEL": "info"}
    with Stack(workers=args.workers, playbooks=args.playbooks, env=stack_env, fsync=args.fsync) as stack, \
            Baseline(args.workers) as base:
        r = redis.Redis.from_url(stack.redis_url, decode_responses=True)
        assert r.config_get("appendfsync")["appendfsync"] == args.fsync
        for group in (10, 1):
            # warm-up: both services, a short run each (imports, connection pools, script cache)
            sent += wrk(stack.url, group, 2)["requests"] * group
            wrk(base.url, group, 2)
            runs: dict[str, list[dict]] = {"trainmedic": [], "baseline": []}
            for i in range(args.rounds):
                order = ("trainmedic", "baseline") if i % 2 == 0 else ("baseline", "trainmedic")
                for who in order:
                    row = wrk(stack.url if who == "trainmedic" else base.url, group, args.seconds)
                    if who == "trainmedic":
                        sent += row["requests"] * group
                    runs[who].append(row)
            results[group] = runs
        time.sleep(1)
        history.catch_up(r)  # what a history query does first
        recorded = r.zcard(keys.HISTORY)
        dispatched = sum(1 for _ in r.scan_iter(match="trainmedic:*:mailbox", count=10000))
        statuses: dict[str, int] = {}
        pipe = r.pipeline(transaction=False)
        sample = r.zrevrange(keys.HISTORY, 0, 999)
        for rid in sample:
            pipe.hget(keys.record(rid), "status")
        for st in pipe.execute():
            statuses[str(st)] = statuses.get(str(st), 0) + 1

    print(f"trainmedic vs baseline: gunicorn {args.workers} workers each, wrk 2 threads 8 connections, "
          f"{args.seconds}s per run, {args.rounds} rounds (median round shown), {os.cpu_count()} cores; every "
          "alert a new fingerprint and a new job")
    print(f"{'stream':<16} {'trainmedic req/s':>16} {'p50 ms':>7} {'p99 ms':>7} {'baseline req/s':>14} "
          f"{'ratio':>6} {'non-2xx':>8}")
    table = []
    for group, runs in results.items():
        t, b = median_row(runs["trainmedic"]), median_row(runs["baseline"])
        ratio = t["rps"] / b["rps"] if b["rps"] else float("inf")
        name = f"{group}-alert groups"
        print(f"{name:<16} {t['rps']:>16.0f} {t['p50_ms']:>7.1f} {t['p99_ms']:>7.1f} {b['rps']:>14.0f} "
              f"{ratio:>5.2f}x {t['non2xx']:>4}/{b['non2xx']:<3}")
        table.append({"group": group, "trainmedic": t, "baseline": b, "ratio": ratio,
                      "trainmedic_rounds": runs["trainmedic"], "baseline_rounds": runs["baseline"]})
    for row in table:
        print(f"  rounds, {row['group']}-alert groups: trainmedic {row['trainmedic']['all_rps']} req/s, "
              f"baseline {row['baseline']['all_rps']} req/s")
    print(f"non-2xx: trainmedic/baseline, summed over rounds. trainmedic: {sent} alerts sent (incl. warm-up), "
          f"{recorded} records, {dispatched} target mailboxes; statuses of the newest 1,000: {statuses}")
    out = ROOT / "benchmarks" / "results"
    out.mkdir(exist_ok=True)
    (out / "baseline_compare.json").write_text(json.dumps({"rows": table, "alerts_sent": sent, "records": recorded,
                                                           "mailboxes": dispatched, "statuses": statuses}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
