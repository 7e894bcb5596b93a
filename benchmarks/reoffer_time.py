"""How long a command claimed by a trainer that died waits before the restarted trainer gets it and applies it.

Run: .venv/bin/python benchmarks/reoffer_time.py [--runs 10]
The service under gunicorn (2 workers, their reconciler threads) on an embedded redis-server; each run starts a
real training process (tests/e2e/crash_trainer.py) that claims a scale_lr command and SIGKILLs itself before
applying it, then starts its replacement at once. Times are from the death (written by the dying process just
before SIGKILL) to: the replacement's first heartbeat, the command offered again (the new mailbox entry's id,
Redis's clock), and the ack `applied` (the record's acked_at). Bounded: each run gives up after 60 s.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from common import Stack, percentile

import redis

from trainmedic.client.wire import keys

from tests.conftest import OPERATOR, SIGNING_KEY
from tests.support.faults import CrashTrainer, record, rfc3339_seconds, send, wait_for


def one_run(stack: Stack, r: redis.Redis, tmp: Path, i: int) -> dict:
    job = f"bench-{i}"
    doomed = CrashTrainer(tmp, job, stack.redis_url, "die")
    restarted = None
    try:
        doomed.wait_beating(r)
        rid = send(stack.url, f"job:{job}", "scale_lr", {"factor": 0.5})
        doomed.wait_killed()
        died = float(doomed.result()["killed_at"])
        restarted = CrashTrainer(tmp, job, stack.redis_url, "apply")
        beat = restarted.wait_beating(r)
        wait_for(lambda: record(stack.url, rid)["status"] == "applied", 60, f"run {i}'s ack", every=0.05)
        acked = rfc3339_seconds(record(stack.url, rid)["actions"][0]["acked_at"])
        entries = [eid for eid, f in r.xrange(keys.mailbox(keys.Target("job", job))) if rid in f["c"]]
        assert len(entries) == 2, entries  # the first offer and the one after the death
        offered = int(entries[-1].split("-")[0]) / 1000
        return {"heartbeat": beat - died, "offered": offered - died, "applied": acked - died,
                "beat_to_offer": offered - beat}
    finally:
        doomed.stop()
        if restarted is not None:
            restarted.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    os.environ.setdefault("TRAINMEDIC_SIGNING_KEY", SIGNING_KEY)
    os.environ.setdefault("TRAINMEDIC_OPERATOR_TOKEN", OPERATOR)
    tmp = Path(tempfile.mkdtemp(prefix="trainmedic-reoffer-"))
    rows = []
    with Stack(workers=2) as stack:
        r = redis.Redis.from_url(stack.redis_url, decode_responses=True)
        for i in range(args.runs):
            rows.append(one_run(stack, r, tmp, i))
            print(f"run {i}: " + ", ".join(f"{k} {v:.2f}s" for k, v in rows[-1].items()), flush=True)
    print(f"\n{args.runs} runs: SIGKILL after the claim, replacement started at once; seconds after the death\n")
    print("| from the death to              | median |   p90 |   min |   max |")
    print("|--------------------------------|--------|-------|-------|-------|")
    names = {"heartbeat": "replacement's first heartbeat", "offered": "command offered again",
             "applied": "applied (acked)", "beat_to_offer": "(first heartbeat to offer)"}
    for k, name in names.items():
        v = [row[k] for row in rows]
        print(f"| {name:<30} | {statistics.median(v):>6.2f} | {percentile(v, 90):>5.2f} | {min(v):>5.2f} | "
              f"{max(v):>5.2f} |")


if __name__ == "__main__":
    main()
