"""GET /history and GET / at scale, answered from the history index (service/history.py).

Run: .venv/bin/python benchmarks/history_scale.py [--records 1000000] [--targets 10000] [--gets 200]
Fill: POST /webhook to gunicorn (4 workers) with 500-alert bodies, 8 senders, into an embedded redis-server;
each alert a new fingerprint on one of --targets jobs, alertnames from 100 (1 % each), two playbooks. Then one
in three of the jobs' records is acked through the real ACK script, the reconciler (in process) expires the
rest past their expiry and decides outcomes, and every query is timed newest first (p50/p99 over --gets).
"""
from __future__ import annotations

import argparse
import copy
import json
import re
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import redis
import requests

from common import ROOT, TOKEN, Stack, percentile

from trainmedic.client.wire import keys
from trainmedic.service.store import record as records
from trainmedic.client.wire.protocol import Ack
from trainmedic.client.wire.redis import run_scripts
from trainmedic.service import history
from trainmedic.service.app import create_app

FIXTURE = json.loads((ROOT / "tests/fixtures/alertmanager-0.25/firing_single.json").read_text())
HEADERS = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
PER_BODY = 500


def body(start: int, targets: int) -> str:
    b = copy.deepcopy(FIXTURE)
    proto = b["alerts"][0]
    alerts = []
    for i in range(start, start + PER_BODY):
        labels = {**proto["labels"], "job_name": f"job-{i % targets}", "alertname": "TrainingLossSpike"}
        if i % 10 == 0:  # 10 %: memory alerts (another playbook)
            labels["alertname"] = "GPUMemoryUsageHigh"
        labels["rule"] = f"r{i % 100}"
        alerts.append({**proto, "labels": labels, "fingerprint": f"{i:016x}"})
    b["alerts"] = alerts
    return json.dumps(b)


def timed(url: str, n: int) -> list[float]:
    s = requests.Session()
    s.get(url, timeout=60).raise_for_status()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        s.get(url, timeout=60).raise_for_status()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def kind_of(key: str) -> str:
    """A key's kind: its name with the target's hash tag, playbook, fingerprint and record id taken out."""
    parts = re.sub(r"\{[^}]*\}:?", "", key.removeprefix(keys.PREFIX)).split(":")
    return ":".join(parts[:2]) if parts[0] == "hist" else parts[0]


def by_kind(r: redis.Redis, n: int) -> None:
    """Where the bytes go: MEMORY USAGE (every element) summed by key kind, per record."""
    total: dict[str, list[int]] = {}
    for key in r.scan_iter(match=keys.PREFIX + "*", count=10_000):
        use = r.memory_usage(key, samples=0) or 0
        kinds = total.setdefault(kind_of(key), [0, 0])
        kinds[0] += 1
        kinds[1] += use
    print("| key kind | keys | bytes per record |\n|---|---|---|")
    for kind, (count, use) in sorted(total.items(), key=lambda kv: -kv[1][1]):
        print(f"| {kind} | {count:,} | {use / max(n, 1):,.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--targets", type=int, default=10_000)
    ap.add_argument("--gets", type=int, default=200)
    ap.add_argument("--by-kind", action="store_true", help="also sum MEMORY USAGE by key kind (slow past 100,000)")
    args = ap.parse_args()
    with Stack(workers=4) as stack:
        r = redis.Redis.from_url(stack.redis_url, decode_responses=True)
        base = int(r.info("memory")["used_memory"])
        t0 = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            def send(start: int) -> None:
                requests.post(stack.url + "/webhook", data=body(start, args.targets), headers=HEADERS,
                              timeout=120).raise_for_status()
            list(pool.map(send, range(0, args.records, PER_BODY)))
        fill_s = time.perf_counter() - t0
        app = create_app({"redis_url": stack.redis_url, "webhook_token": TOKEN, "operator_token": "op" * 16,
                          "signing_key": "k" * 32, "playbooks": str(ROOT / "playbooks")})
        svc = app.extensions["trainmedic"]
        t1 = time.perf_counter()
        history.catch_up(r, wait=60)
        ids = [rid for rid, _ in r.zscan_iter(keys.HISTORY, count=10_000)]
        acks = []
        for rid in ids[::3]:
            rec = records.get(r, rid)
            if rec and rec["status"] == "dispatched":
                acks += [Ack(rid, i, a["action"], "applied", {}, "bench:1") for i, a in enumerate(rec["actions"])]
        for i in range(0, len(acks), 1000):
            run_scripts(r, records.ack_calls(svc.dispatcher.scripts, acks[i:i + 1000], time.time()))
        while svc.reconciler.tick(time.time() + 7200).targets:
            pass
        history.catch_up(r, wait=60)
        mark_s = time.perf_counter() - t1
        n = int(r.zcard(keys.HISTORY))
        per_record = (int(r.info("memory")["used_memory"]) - base) / max(n, 1)
        deep = stack.url + "/history"
        cursor = None
        for _ in range(200):
            page = requests.get(deep + (f"?before={cursor}" if cursor else ""), timeout=60).json()
            cursor = page["next"] or cursor
        queries = {
            "GET /history": "/history",
            "status=applied": "/history?status=applied",
            "status=expired": "/history?status=expired",
            "status=dispatched (none left)": "/history?status=dispatched",
            "outcome=ineffective": "/history?outcome=ineffective",
            "playbook=gpu-memory-high (10 %)": "/history?playbook=gpu-memory-high",
            "alertname=GPUMemoryUsageHigh": "/history?alertname=GPUMemoryUsageHigh",
            "target=job:job-7": "/history?target=job:job-7",
            "alertname+status=applied": "/history?alertname=TrainingLossSpike&status=applied",
            "target+status=expired": "/history?target=job:job-7&status=expired",
            "deep paging (page 200)": f"/history?before={cursor}",
            "GET /": "/",
        }
        print(f"records {n:,}, targets {args.targets:,}, fill {fill_s:.0f} s ({n / fill_s:,.0f}/s through POST "
              f"/webhook), acks+expiry+index {mark_s:.0f} s, Redis {per_record:,.0f} bytes/record")
        if args.by_kind:
            by_kind(r, n)
        print("| query | p50 ms | p99 ms | items |\n|---|---|---|---|")
        for label, path in queries.items():
            ms = timed(stack.url + path, args.gets)
            items = len(requests.get(stack.url + path, timeout=60).json()["items"]) if path != "/" else "-"
            print(f"| {label} | {statistics.median(ms):.1f} | {percentile(ms, 99):.1f} | {items} |")


if __name__ == "__main__":
    main()
