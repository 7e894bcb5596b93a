"""Redis memory under a long alert stream with retention: does it flatten once TRAINMEDIC_HISTORY_MAX is reached?

Run: .venv/bin/python benchmarks/retention_memory.py [--alerts 1000000] [--targets 10000] [--history-max 200000]
Streams unique firing alerts (new fingerprints, bodies of 500 alerts) over many job targets through the real
webhook (gunicorn, 4 workers) into an embedded redis-server (AOF off: memory is what is measured), and prints
Redis `INFO memory` used_memory every 100,000 alerts with the keys that hold it. The playbook has a cooldown,
as the shipped ones do: the first alert of each target is dispatched, the rest are recorded `skipped`.
Bounded: stops after --max-seconds (default 840) whatever it has sent, and says so.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import TOKEN, Stack

import redis
import requests

from trainmedic.client.wire import keys
from trainmedic.service.embedded_redis import EmbeddedRedis
from trainmedic.service import history

PLAYBOOK = """\
playbooks:
  - name: loss-spike
    matchers: ['alertname="TrainingLossSpike"']
    target: job
    actions: [{scale_lr: {factor: 0.5, min_lr: 1.0e-7}}]
    cooldown: 1h
"""
BODY = 500


def body(start: int, targets: int) -> bytes:
    alerts = [{"status": "firing", "labels": {"alertname": "TrainingLossSpike", "job_name": f"job-{i % targets}",
                                              "severity": "critical", "instance": f"gpu-{i % targets}:9445"},
               "annotations": {"summary": "Training loss spike detected",
                               "description": f"loss jumped at step {i}"},
               "startsAt": "2026-11-22T01:00:00.123Z", "endsAt": "0001-01-01T00:00:00Z",
               "generatorURL": "http://prometheus:9090/graph?g0.expr=loss", "fingerprint": f"{i:016x}"}
              for i in range(start, start + BODY)]
    return json.dumps({"version": "4", "status": "firing", "receiver": "trainmedic", "groupKey": "{}:{}",
                       "groupLabels": {}, "commonLabels": {}, "commonAnnotations": {}, "externalURL": "",
                       "alerts": alerts}).encode()


def sample(r: redis.Redis, sent: int, t0: float, base: int) -> dict:
    used = int(r.info("memory")["used_memory"])
    history.catch_up(r)
    records = int(r.zcard(keys.HISTORY))
    return {"alerts": sent, "seconds": round(time.monotonic() - t0, 1), "used_mb": round(used / 2**20, 1),
            "records": records, "keys": int(r.dbsize()),
            "bytes_per_record": round((used - base) / records) if records else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--alerts", type=int, default=1_000_000)
    ap.add_argument("--targets", type=int, default=10_000)
    ap.add_argument("--history-max", type=int, default=200_000)
    ap.add_argument("--every", type=int, default=100_000)
    ap.add_argument("--max-seconds", type=float, default=840.0)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="trainmedic-retention-"))
    pb = tmp / "playbooks.yaml"
    pb.write_text(PLAYBOOK)
    server = EmbeddedRedis(tmp / "redis", appendonly=False).start()
    os.environ["TRAINMEDIC_HISTORY_MAX"] = str(args.history_max)
    os.environ.setdefault("TRAINMEDIC_SIGNING_KEY", "bench-signing-key-" + "0123456789abcdef" * 2)
    rows = []
    try:
        with Stack(workers=4, playbooks=str(pb), redis_url=server.url) as stack:
            r = redis.Redis.from_url(server.url)
            base = int(r.info("memory")["used_memory"])
            rows.append(sample(r, 0, time.monotonic(), base))
            session = requests.Session()
            session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=8))
            headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
            lock = threading.Lock()
            done = [0, 0]  # alerts sent, errors
            t0 = time.monotonic()

            def post(start: int) -> None:
                if time.monotonic() - t0 > args.max_seconds:
                    return
                resp = session.post(stack.url + "/webhook", data=body(start, args.targets), headers=headers,
                                    timeout=120)
                with lock:
                    done[0] += BODY
                    done[1] += resp.status_code != 200

            next_sample = args.every
            with ThreadPoolExecutor(4) as pool:
                for chunk in range(0, args.alerts, args.every):
                    list(pool.map(post, range(chunk, min(args.alerts, chunk + args.every), BODY)))
                    if done[0] >= next_sample:
                        rows.append(sample(r, done[0], t0, base))
                        print(rows[-1], flush=True)
                        next_sample += args.every
                    if time.monotonic() - t0 > args.max_seconds:
                        print(f"stopped after {args.max_seconds:.0f}s at {done[0]} alerts", flush=True)
                        break
            time.sleep(5)  # the reconciler's last retention passes
            rows.append({**sample(r, done[0], t0, base), "alerts": f"{done[0]} +5s"})
            kinds: dict[str, int] = {}
            for k in r.scan_iter(count=10_000):
                kind = k.decode().split("}:", 1)[-1].split(":")[0]
                kinds[kind] = kinds.get(kind, 0) + 1
            print(f"errors: {done[1]}; keys by kind at the end: {dict(sorted(kinds.items()))}")
    finally:
        server.stop()
    print(f"\n{args.alerts:,} alerts over {args.targets:,} targets, bodies of {BODY}, "
          f"TRAINMEDIC_HISTORY_MAX={args.history_max:,}\n")
    print(f"| {'alerts':>12} | {'s':>6} | {'used_memory MB':>14} | {'records':>8} | {'keys':>9} | {'B/record':>8} |")
    print(f"|{'-' * 14}|{'-' * 8}|{'-' * 16}|{'-' * 10}|{'-' * 11}|{'-' * 10}|")
    for row in rows:
        print(f"| {row['alerts']:>12} | {row['seconds']:>6} | {row['used_mb']:>14} | {row['records']:>8} | "
              f"{row['keys']:>9} | {row['bytes_per_record'] or '-':>8} |")


if __name__ == "__main__":
    main()
