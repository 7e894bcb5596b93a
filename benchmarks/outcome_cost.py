"""Outcomes: how soon a resolve makes a record `effective`, and what 10,000 open outcomes cost the reconciler.

Run: .venv/bin/python benchmarks/outcome_cost.py [--records 10000] [--targets 1000] [--samples 50]
The service in this process on an embedded redis-server (AOF off); records made through the webhook and
acknowledged through each target's mailbox, as a training client does. Scenarios:
  latency   the reconciler's own thread (1 s tick) running: a resolve notification arrives (endsAt = now);
            time until GET /remediations/<id> says effective. Alertmanager adds its group_interval before
            the notification (the `make demo` timeline shows the whole path).
  idle      10,000 outcomes pending, none due (verify 15m): one tick a second for 10 s
  verdict   all verify deadlines pass at once, no Alertmanager API: every record ends ineffective
  resolve   10,000 resolve notifications, then ticks until every record is effective
Redis commands come from INFO commandstats deltas (inside Lua scripts too), CPU from time.process_time().
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from common import SIGNING_KEY, TOKEN

import redis

from trainmedic.client.receiver.mailbox import Mailbox
from trainmedic.client.wire import keys
from trainmedic.service.store import record as records
from trainmedic.client.wire.protocol import Ack
from trainmedic.service.app import create_app
from trainmedic.service.embedded_redis import EmbeddedRedis

PLAYBOOK = """\
playbooks:
  - name: loss-spike
    matchers: ['alertname="TrainingLossSpike"']
    target: job
    verify: 15m
    actions: [{scale_lr: {factor: 0.5, min_lr: 1.0e-7}}]
"""
STARTS = "2026-11-22T01:00:00Z"


def commands(r: redis.Redis) -> int:
    return sum(int(v["calls"]) for v in r.info("commandstats").values())


def notify(http: Any, status: str, ids: range, targets: int, ends: str = "0001-01-01T00:00:00Z") -> list[str]:
    made = []
    for start in range(ids.start, ids.stop, 500):
        alerts = [{"status": status, "labels": {"alertname": "TrainingLossSpike", "job_name": f"job-{i % targets}"},
                   "annotations": {}, "startsAt": STARTS, "endsAt": ends, "fingerprint": f"{i:016x}"}
                  for i in range(start, min(ids.stop, start + 500))]
        resp = http.post("/webhook", data=json.dumps({"version": "4", "status": status, "receiver": "b",
                                                      "alerts": alerts}),
                         content_type="application/json", headers={"Authorization": f"Bearer {TOKEN}"})
        assert resp.status_code == 200, resp.get_json()
        made += [m["id"] for m in resp.get_json()["remediations"]]
    return made


def ack_all(r: redis.Redis, targets: int) -> None:
    """Each target's process claims and acknowledges everything in its mailbox."""
    for t in range(targets):
        box = Mailbox(r, keys.Target("job", f"job-{t}"))
        acks = []
        for entry in box.fetch(count=1000):
            assert entry.command is not None and box.claim(entry, f"host:{t}") == "ok"
            acks += [Ack(entry.command.record_id, a.index, a.action, "applied", {"step": 1}, f"host:{t}")
                     for a in entry.command.actions]
        box.ack(acks)


def outcome_counts(r: redis.Redis, ids: list[str]) -> dict[str, int]:
    pipe = r.pipeline(transaction=False)
    for rid in ids:
        pipe.hget(keys.record(rid), "outcome")
    out: dict[str, int] = {}
    for raw in pipe.execute():
        status = json.loads(raw)["status"] if raw else "none"
        out[status] = out.get(status, 0) + 1
    return out


def ticks_until(rec: Any, r: redis.Redis, ids: list[str], status: str, now: float) -> dict[str, float]:
    c0, cpu0, t0, n = commands(r), time.process_time(), time.perf_counter(), 0
    while outcome_counts(r, ids).get(status, 0) < len(ids):
        rec.tick(now + n)  # a tick a second, as the reconciler's thread runs them
        n += 1
        assert n < 500, outcome_counts(r, ids)
    wall = time.perf_counter() - t0
    return {"ticks": n, "wall_s": round(wall, 3), "service_cpu_s": round(time.process_time() - cpu0, 3),
            "redis_commands_per_record": round((commands(r) - c0) / len(ids), 1),
            "records_per_s": round(len(ids) / wall)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=10_000)
    ap.add_argument("--targets", type=int, default=1_000)
    ap.add_argument("--samples", type=int, default=50)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="trainmedic-outcomes-"))
    (tmp / "pb.yaml").write_text(PLAYBOOK)
    server = EmbeddedRedis(tmp / "redis", appendonly=False).start()
    results: dict[str, Any] = {"records": args.records, "targets": args.targets}
    try:
        r = redis.Redis.from_url(server.url, decode_responses=True)
        app = create_app({"redis_url": server.url, "webhook_token": TOKEN, "signing_key": SIGNING_KEY,
                          "playbooks": str(tmp / "pb.yaml")})
        http = app.test_client()
        reconciler = app.extensions["trainmedic"].reconciler

        # latency: resolve notification -> effective on the record, with the reconciler's own thread.
        reconciler.start()
        lat = []
        for i in range(args.samples):
            rid = notify(http, "firing", range(10**6 + i, 10**6 + i + 1), 1)[0]
            ack_all(r, 1)
            while (records.get(r, rid) or {}).get("outcome") is None:
                time.sleep(0.001)
            time.sleep(0.05)
            sent = time.time()
            notify(http, "resolved", range(10**6 + i, 10**6 + i + 1), 1,
                   ends=time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sent)) + f".{int(sent % 1 * 1000):03d}Z")
            while (records.get(r, rid) or {}).get("outcome", {}).get("status") != "effective":
                time.sleep(0.002)
            lat.append(time.time() - sent)
        reconciler.stop()
        r.flushall()
        reconciler.mark_epoch()  # a fresh keyspace on purpose, not a Redis that lost its data
        lat.sort()
        results["resolve_to_effective_s"] = {"p50": round(statistics.median(lat), 3),
                                             "p95": round(lat[int(0.95 * (len(lat) - 1))], 3),
                                             "max": round(lat[-1], 3), "samples": len(lat)}
        print(f"resolve notification -> effective: p50 {results['resolve_to_effective_s']['p50']} s, "
              f"p95 {results['resolve_to_effective_s']['p95']} s, max {results['resolve_to_effective_s']['max']} s "
              f"({len(lat)} samples, reconciler tick 1 s)")

        for scenario in ("verdict", "resolve"):
            ids = notify(http, "firing", range(args.records), args.targets)
            ack_all(r, args.targets)
            now = time.time()
            # The settle pokes: each record gets its verify deadline (a tick visits at most targets_per_tick).
            while r.zrangebyscore(keys.DUE, "-inf", int(now * 1000), start=0, num=1):
                reconciler.tick(now)
            if scenario == "verdict":
                c0, cpu0 = commands(r), time.process_time()
                for k in range(10):
                    reconciler.tick(now + k)
                results["idle_10_ticks"] = {"redis_commands": commands(r) - c0,
                                            "service_cpu_s": round(time.process_time() - cpu0, 4)}
                print(f"idle, {args.records} pending: 10 ticks = {results['idle_10_ticks']['redis_commands']} Redis "
                      f"commands, {results['idle_10_ticks']['service_cpu_s']} s service CPU")
                results["verdict"] = ticks_until(reconciler, r, ids, "ineffective", now + 15 * 60 + 301)
            else:
                notify(http, "resolved", range(args.records), args.targets, ends="2026-11-22T09:00:00Z")
                results["resolve"] = ticks_until(reconciler, r, ids, "effective", now + 1)
            print(f"{scenario}: {results[scenario]}")
            r.flushall()
            reconciler.mark_epoch()
    finally:
        server.stop()
    out = Path(__file__).with_name("results") / "outcome_cost.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
