"""What the reconciler costs Redis and the service with 10,000 open records (dispatched, not acknowledged).

Run: .venv/bin/python benchmarks/reconciler_cost.py [--records 10000] [--targets 1000]
The service in this process on an embedded redis-server (AOF off); records made through the webhook. Redis
commands come from INFO commandstats deltas (commands run inside the Lua scripts count too), Redis CPU from
INFO cpu, the service's CPU from time.process_time() around Reconciler.tick(). Scenarios:
  idle      nothing is due (commands expire in an hour): the background thread ticking once a second, 10 s
  restart   every job restarts at once (a first heartbeat from a new process on every target) while all its
            records are claimed by the dead one: the claims are offered again
  expiry    all records pass their expiry at once and end `expired`
Bounded: a few minutes at most.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from common import SIGNING_KEY, TOKEN

import redis

from trainmedic.client.receiver.mailbox import Mailbox
from trainmedic.service.beats import announce
from trainmedic.client.wire import keys
from trainmedic.service.app import create_app
from trainmedic.service.embedded_redis import EmbeddedRedis
from trainmedic.service import history

PLAYBOOK = """\
playbooks:
  - name: loss-spike
    matchers: ['alertname="TrainingLossSpike"']
    target: job
    expire_after: 1h
    actions: [{scale_lr: {factor: 0.5, min_lr: 1.0e-7}}]
"""


def calls(r: redis.Redis) -> tuple[int, int, float]:
    """(all commands, script calls, Redis CPU seconds) so far."""
    stats = r.info("commandstats")
    total = sum(int(v["calls"]) for v in stats.values())
    scripts = sum(int(v["calls"]) for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))
    cpu = r.info("cpu")
    return total, scripts, float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def make_records(app, n: int, targets: int) -> None:
    http = app.test_client()
    for start in range(0, n, 500):
        alerts = [{"status": "firing", "labels": {"alertname": "TrainingLossSpike", "job_name": f"job-{i % targets}"},
                   "annotations": {}, "startsAt": "2026-11-22T01:00:00Z", "endsAt": "0001-01-01T00:00:00Z",
                   "fingerprint": f"{i:016x}"} for i in range(start, min(n, start + 500))]
        resp = http.post("/webhook", data=json.dumps({"version": "4", "status": "firing", "receiver": "t",
                                                      "alerts": alerts}),
                         content_type="application/json", headers={"Authorization": f"Bearer {TOKEN}"})
        assert resp.status_code == 200, resp.get_json()


def ticks(rc, r: redis.Redis, now: float, what: str) -> dict:
    """Tick at `now` until a tick finds no target due (that empty tick counted too); the cost per tick."""
    c0 = calls(r)
    n, changed, cpu, wall, targets, last_change = 0, 0, 0.0, 0.0, 0, 0.0
    while True:
        t, p = time.perf_counter(), time.process_time()
        report = rc.tick(now)
        wall += time.perf_counter() - t
        cpu += time.process_time() - p
        n += 1
        changed += len(report.changed)
        targets += report.targets
        if report.changed:
            last_change = wall  # when the last record of the scenario became terminal
        if report.targets == 0 or n >= 100:
            break
    c1 = calls(r)
    return {"scenario": what, "ticks": n, "changed": changed, "wall_ms": 1000 * wall / n,
            "cpu_ms": 1000 * cpu / n, "redis_cpu_ms": 1000 * (c1[2] - c0[2]) / n,
            "redis_cmds": (c1[0] - c0[0]) / n, "scripts": (c1[1] - c0[1]) / n, "targets_per_s": targets / wall,
            "terminal_s": last_change}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=10_000)
    ap.add_argument("--targets", type=int, default=1_000)
    ap.add_argument("--idle-seconds", type=float, default=10.0)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="trainmedic-reconciler-"))
    (tmp / "pb.yaml").write_text(PLAYBOOK)
    server = EmbeddedRedis(tmp / "redis", appendonly=False).start()
    rows = []
    try:
        r = redis.Redis.from_url(server.url, decode_responses=True)
        app = create_app({"TESTING": True, "redis_url": server.url, "webhook_token": TOKEN,
                          "signing_key": SIGNING_KEY, "playbooks": str(tmp / "pb.yaml")})
        rc = app.extensions["trainmedic"].reconciler
        t = time.perf_counter()
        make_records(app, args.records, args.targets)
        made = time.perf_counter() - t
        history.catch_up(r)
        assert r.zcard(keys.HISTORY) == args.records
        rc.tick()  # the first pass after the records were made: every target's first look

        # idle: the real background thread, once a second
        c0, p0 = calls(r), time.process_time()
        rc.start()
        time.sleep(args.idle_seconds)
        rc.stop()
        c1, p1 = calls(r), time.process_time()
        secs = args.idle_seconds
        rows.append({"scenario": "idle (thread, 1/s)", "ticks": round(secs), "changed": 0,
                     "wall_ms": float("nan"), "cpu_ms": 1000 * (p1 - p0) / secs,
                     "redis_cpu_ms": 1000 * (c1[2] - c0[2]) / secs, "redis_cmds": (c1[0] - c0[0]) / secs,
                     "scripts": (c1[1] - c0[1]) / secs})

        # restart: every record claimed by a process that died, a new process heartbeats on every target
        for i in range(args.targets):
            box = Mailbox(r, keys.Target("job", f"job-{i}"))
            while entries := box.fetch():
                for e in entries:
                    assert box.claim(e, "old-host:1") == "ok"
        for i in range(args.targets):
            Mailbox(r, keys.Target("job", f"job-{i}")).heartbeat({"host": "new-host", "pid": 2})
        # What the service does when it hears them announce themselves.
        announce(r, [keys.Target("job", f"job-{i}") for i in range(args.targets)])
        # The reconciler's next passes, once the claims are older than its recheck (10 s).
        rows.append(ticks(rc, r, time.time() + 11, "restart (re-offer all)"))
        offered = sum(int(r.hget(keys.record(rid), "offers") or 0) for rid in r.zrange(keys.HISTORY, 0, -1))

        # expiry: everything passes its expiry at once
        rows.append(ticks(rc, r, time.time() + 3601, "expiry (end all)"))
        ended = sum(1 for rid in r.zrange(keys.HISTORY, 0, -1)
                    if r.hget(keys.record(rid), "status") == "expired")
    finally:
        server.stop()
    print(f"\n{args.records:,} open records over {args.targets:,} job targets (made in {made:.1f}s); "
          f"restart: {offered:,} commands offered again; expiry: {ended:,} records ended expired\n")
    print("| scenario               | ticks | records ended | service CPU ms/tick | Redis CPU ms/tick | "
          "Redis cmds/tick | script calls/tick | wall ms/tick |")
    print("|------------------------|-------|---------------|---------------------|-------------------|"
          "-----------------|-------------------|--------------|")
    for row in rows:
        print(f"| {row['scenario']:<22} | {row['ticks']:>5} | {row['changed']:>13} | {row['cpu_ms']:>19.1f} | "
              f"{row['redis_cpu_ms']:>17.1f} | "
              f"{row['redis_cmds']:>15.0f} | {row['scripts']:>17.0f} | {row['wall_ms']:>12.1f} |")
    idle = rows[0]
    print(f"\nidle: {idle['redis_cmds']:.0f} Redis commands/s caused by the reconciler thread, "
          f"{idle['cpu_ms'] / args.targets * 1000:.2f} µs of service CPU a second per idle target")
    for row in rows[1:]:
        print(f"{row['scenario']}: {row['targets_per_s']:,.0f} targets visited a second"
              + (f"; every record terminal {row['terminal_s']:.1f}s after the first pass began"
                 if row["changed"] else ""))


if __name__ == "__main__":
    main()
