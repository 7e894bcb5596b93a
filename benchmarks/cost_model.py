"""What one alert costs the webhook's path, for sizing Redis: commands, Redis CPU, service CPU, bytes per record.

In-process (Flask's test client, no gunicorn, no HTTP), an embedded redis-server with AOF (`appendfsync
everysec` as the service runs it, or --fsync always),
the shipped playbooks, the signing key on and logging at info (to /dev/null, JSON lines as in production).
Every alert is TrainingLossSpike with a new fingerprint and a new job (the storm of baseline_compare.py), in
groups of 1 and of 10. Measured first on an empty Redis, then after filling it through the webhook with
--fill records spread over --targets jobs, so one sees how each figure grows with what Redis holds.

CPU is process CPU time (time.process_time for the service; Redis INFO cpu, user + sys, for Redis), not
wall-clock, so other work on the machine changes it little. "Beyond floor" is the service's CPU per alert less
the framework floor's per request (webhook_bound.py's floor app: token, parse, answer) over the alerts a
request carries, measured in the same run through the same test client. Commands per alert are INFO commandstats calls
(an EVALSHA counts once, and each command its script runs counts too). Bytes per record: INFO memory's
used_memory delta over the records made (record hash, mailbox entry, episode, cooldown, budget, indexes);
a storm row makes a new job per alert, so it also pays for a new mailbox stream and a target's keys, and a
main-dict rehash can land in one row (see "at the end" and "the fill" for averages). Also per alert: bytes
appended to the AOF, and the time spent inside the scripts (commandstats usec of EVALSHA).

    .venv/bin/python benchmarks/cost_model.py                         # 0 and 100,000 records / 10,000 jobs
    .venv/bin/python benchmarks/cost_model.py --fill 0 --alerts 500   # quick
    .venv/bin/python benchmarks/cost_model.py --breaker               # the breaker's cost: max_active or not

--breaker measures the webhook's path with the shipped loss-spike playbook as it ships (no max_active), and
with max_active {count: N} or {percent: 100} (of 10,000 live jobs) where N and the live jobs are far above
the alerts sent, so every alert is still claimed and dispatched: the difference is the claim (lua/breaker.lua,
one more round trip a notification) and, for the percent form, reading the live targets (at most once a
second). The claim counts the distinct targets of the open claims, so it is also measured with 1,000 and
10,000 claims already open. Each variant gets a fresh Redis; the variants take turns, round after round, and
the medians are printed.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import redis  # noqa: E402
import yaml  # noqa: E402

from common import ROOT, SIGNING_KEY, TOKEN  # noqa: E402
from trainmedic.client import logs  # noqa: E402
from trainmedic.service.app import create_app  # noqa: E402
from trainmedic.service.embedded_redis import EmbeddedRedis  # noqa: E402
from trainmedic.service import history  # noqa: E402
from trainmedic.client.wire import keys  # noqa: E402

HEADERS = {"Authorization": "Bearer " + TOKEN, "Content-Type": "application/json"}


def body(run: str, first: int, group: int, jobs: int | None = None) -> str:
    """A firing notification of `group` TrainingLossSpike alerts, numbered from `first` (new fingerprints)."""
    alerts = []
    for n in range(first, first + group):
        job = n % jobs if jobs else n
        alerts.append({
            "status": "firing",
            "labels": {"alertname": "TrainingLossSpike", "cluster": "gpu-east-2", "job_name": f"llm-{run}-{job}",
                       "severity": "critical", "team": "llm", "instance": f"gpu-node-{n % 2048}:9445"},
            "annotations": {"summary": "Training loss spike detected",
                            "description": f"Training loss for job llm-{job} increased by 3.2x over 5m"},
            "startsAt": f"2026-11-22T01:{(n // 60) % 60:02d}:{n % 60:02d}.123456789Z",
            "endsAt": "0001-01-01T00:00:00Z",
            "generatorURL": "http://prometheus:9090/graph?g0.expr=increase%28train_loss%5B5m%5D%29&g0.tab=1",
            "fingerprint": f"{zlib.crc32(run.encode()) & 0xffff:04x}{n:012x}"})
    return json.dumps({"version": "4", "status": "firing", "receiver": "trainmedic", "groupKey": "{}:{}",
                       "alerts": alerts})


def snapshot(r: redis.Redis) -> tuple[int, float, int, int, int]:
    """(command calls but INFO's own, Redis CPU seconds (user + sys), used_memory, AOF bytes, EVALSHA usec)."""
    stats = r.info("commandstats")
    calls = sum(v["calls"] for k, v in stats.items() if k != "cmdstat_info")
    cpu = r.info("cpu")
    return (calls, cpu["used_cpu_user"] + cpu["used_cpu_sys"], int(r.info("memory")["used_memory"]),
            int(r.info("persistence").get("aof_current_size", 0)), int(stats.get("cmdstat_evalsha", {}).get("usec", 0)))


def measure(http: Any, r: redis.Redis, group: int, alerts: int, run: str) -> dict[str, float]:
    reconciler = http.application.extensions["trainmedic"].reconciler
    bodies = [body(run, i * group, group) for i in range(alerts // group)]
    for b in [body(run + "w", i * group, group) for i in range(5)]:  # warm-up: scripts loaded, caches filled
        assert http.post("/webhook", data=b, headers=HEADERS).status_code == 200
    history.catch_up(r)
    hist0 = r.zcard("trainmedic:history")
    calls0, cpu0, mem0, aof0, eval0 = snapshot(r)
    t0 = time.process_time()
    w0 = time.perf_counter()
    for b in bodies:
        resp = http.post("/webhook", data=b, headers=HEADERS)
        assert resp.status_code == 200, resp.get_data()
    svc = time.process_time() - t0
    wall = time.perf_counter() - w0
    calls1, cpu1, mem1, aof1, eval1 = snapshot(r)
    # All in: what the reconciler's pass and the history's fold then do for these alerts (as the service does
    # within a second of the webhook), on top of the webhook's own.
    reconciler.tick()
    history.catch_up(r)  # index what this pass journaled, so its memory counts too
    calls2, cpu2, mem2, aof2, _ = snapshot(r)
    made = r.zcard("trainmedic:history") - hist0
    n = len(bodies) * group
    return {"cmds": (calls1 - calls0) / n, "redis_us": (cpu1 - cpu0) / n * 1e6, "svc_us": svc / n * 1e6,
            "bytes": (mem2 - mem0) / max(made, 1), "aof": (aof1 - aof0) / n,
            "eval_us": (eval1 - eval0) / n, "wall_us": wall / n * 1e6, "alerts": n, "records": made,
            "all_cmds": (calls2 - calls0) / n, "all_redis_us": (cpu2 - cpu0) / n * 1e6, "all_aof": (aof2 - aof0) / n}


def floor_us(group: int, alerts: int) -> float:
    """The framework floor's CPU per request (webhook_bound.py's floor app, through Flask's test client)."""
    from webhook_bound import floor_app

    http = floor_app().test_client()
    bodies = [body("floor", i * group, group) for i in range(max(alerts // group, 200))]
    for b in bodies[:20]:
        http.post("/webhook", data=b, headers=HEADERS)
    t0 = time.process_time()
    for b in bodies:
        assert http.post("/webhook", data=b, headers=HEADERS).status_code == 200
    return (time.process_time() - t0) / len(bodies) * 1e6


def fill(http: Any, records_n: int, targets: int) -> float:
    """Fill Redis through the webhook: records_n alerts over `targets` jobs, 100 alerts a notification."""
    t0 = time.perf_counter()
    for first in range(0, records_n, 100):
        resp = http.post("/webhook", data=body("fill", first, min(100, records_n - first), targets), headers=HEADERS)
        assert resp.status_code == 200, resp.get_data()
    return time.perf_counter() - t0


@contextmanager
def in_process(playbooks: Path = ROOT / "playbooks", fsync: str = "everysec") -> Iterator[tuple[Any, redis.Redis]]:
    """The app's test client and a client of its embedded Redis (AOF, fsync as given), logging at info."""
    tmp = Path(tempfile.mkdtemp(prefix="trainmedic-cost-"))
    srv = EmbeddedRedis(tmp / "redis", fsync=fsync).start()
    devnull = open(os.devnull, "w")
    try:
        app = create_app({"redis_url": srv.url, "webhook_token": TOKEN, "signing_key": SIGNING_KEY,
                          "playbooks": str(playbooks)})
        logs.setup("info", devnull)  # one JSON line per remediation, as under gunicorn at info
        logging.getLogger("trainmedic.reconciler").setLevel(logging.WARNING)
        yield app.test_client(), redis.Redis.from_url(srv.url, decode_responses=True)
    finally:
        srv.stop()
        devnull.close()


def bounded_playbooks(folder: Path, max_active: dict[str, int] | None) -> Path:
    """The shipped playbooks with loss-spike's max_active set (None: as shipped) in folder/default.yaml."""
    doc = yaml.safe_load((ROOT / "playbooks" / "default.yaml").read_text())
    for pb in doc["playbooks"]:
        if pb["name"] == "loss-spike":
            assert "max_active" not in pb, "the shipped loss-spike playbook is bounded already"
            if max_active is not None:
                pb["max_active"] = max_active
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "default.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return folder


def median(values: list[float]) -> float:
    v = sorted(values)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


def breaker(alerts: int, rounds: int) -> None:
    """The webhook's cost per alert without and with the breaker, the variants taking turns on fresh Redis."""
    big = 1_000_000  # the largest bound, one no row reaches: every alert is claimed and dispatched
    variants = [("no max_active (as shipped)", None, 0, 0),
                ("count, 0 open claims", {"count": big}, 0, 0),
                ("percent, 0 open claims", {"percent": 100}, 0, big),
                ("count, 1,000 open claims", {"count": big}, 1_000, 0),
                ("count, 10,000 open claims", {"count": big}, 10_000, 0)]
    tmp = Path(tempfile.mkdtemp(prefix="trainmedic-breaker-"))
    runs: dict[tuple[str, int], list[dict[str, float]]] = {}
    for rnd in range(rounds):
        for v, (label, bound, held, live) in enumerate(variants):
            with in_process(bounded_playbooks(tmp / f"v{v}", bound)) as (http, r):
                until = (time.time() + 3600) * 1000
                if live:  # live jobs for the percent form to count (only ZCOUNT reads them, at most once a second)
                    r.zadd(keys.live("job"), {f"job:live-{n}": until for n in range(10_000)})
                # Claims of other open remediations, each its own target, as breaker.lua keeps them.
                for first in range(0, held, 10_000):
                    r.zadd(keys.breaker_open("loss-spike"), {f"01J{n:023d}~job~held-{n}": until
                                                             for n in range(first, min(held, first + 10_000))})
                for group in (1, 10):
                    m = measure(http, r, group, alerts, f"b{rnd}{v}g{group}")
                    assert m["records"] == m["alerts"], m
                    runs.setdefault((label, group), []).append(m)
                # Below the bound throughout: the breaker never opened, so no alert was skipped for it.
                assert not r.exists(keys.breaker_state("loss-spike")), f"{label}: the breaker opened"
    print(f"breaker cost per alert: in-process webhook (Flask test client), AOF appendfsync always, signing on, "
          f"logging at info; loss-spike without and with max_active (a bound no row reaches); {alerts} alerts "
          f"per row (each a new fingerprint, a new job and one more open claim), every one dispatched; median of "
          f"{rounds} rounds, the variants taking turns on fresh Redis; CPU is process time")
    print(f"{'max_active of loss-spike':34s} {'alerts/req':>10s} {'cmds/alert':>10s} {'Redis CPU us':>12s} "
          f"{'service CPU us':>14s} {'EVALSHA us':>10s} {'wall us':>8s}")
    for (label, group), ms in runs.items():
        print(f"{label:34s} {group:10d} {median([m['cmds'] for m in ms]):10.1f} "
              f"{median([m['redis_us'] for m in ms]):12.0f} {median([m['svc_us'] for m in ms]):14.0f} "
              f"{median([m['eval_us'] for m in ms]):10.0f} {median([m['wall_us'] for m in ms]):8.0f}")
    print("range over rounds, Redis CPU us / service CPU us: " + "; ".join(
        f"{label} x{group}: {min(m['redis_us'] for m in ms):.0f}-{max(m['redis_us'] for m in ms):.0f} / "
        f"{min(m['svc_us'] for m in ms):.0f}-{max(m['svc_us'] for m in ms):.0f}"
        for (label, group), ms in runs.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--alerts", type=int, default=2000, help="alerts measured per row (default 2000)")
    ap.add_argument("--fill", type=int, default=100_000, help="records to add before the second pass (0: none)")
    ap.add_argument("--targets", type=int, default=10_000, help="jobs the fill spreads over")
    ap.add_argument("--breaker", action="store_true", help="compare loss-spike without and with max_active instead")
    ap.add_argument("--rounds", type=int, default=3, help="with --breaker: rounds of the variants (default 3)")
    ap.add_argument("--fsync", choices=("everysec", "always"), default="everysec", help="Redis's appendfsync")
    args = ap.parse_args()
    if args.breaker:
        breaker(args.alerts, args.rounds)
        return

    floor = {group: floor_us(group, args.alerts) for group in (1, 10)}
    with in_process(fsync=args.fsync) as (http, r):
        rows: list[tuple[str, int, dict[str, float]]] = []
        fill_line = ""
        passes = [("empty Redis", 0)] + ([(f"{args.fill:,} records / {args.targets:,} jobs", args.fill)]
                                         if args.fill else [])
        for label, n in passes:
            if n:
                mem0, hist0 = int(r.info("memory")["used_memory"]), r.zcard("trainmedic:history")
                took = fill(http, n, args.targets)
                history.catch_up(r)
                made = r.zcard("trainmedic:history") - hist0
                fill_line = (f"the fill: {made:,} records over {args.targets:,} jobs ({n // args.targets} a job) in "
                             f"{took:.0f}s, {(int(r.info('memory')['used_memory']) - mem0) / max(made, 1):.0f} "
                             f"bytes per record")
            for group in (1, 10):
                rows.append((label, group, measure(http, r, group, args.alerts, f"g{group}{n}")))
        info = r.info("server")
        print(f"cost per alert: in-process webhook (Flask test client), redis-server {info['redis_version']} with AOF "
              f"appendfsync {args.fsync}, signing on, logging at info; {args.alerts} alerts per row, each a new "
              f"fingerprint and a new job; CPU is process time; the floor's CPU per request: "
              f"{floor[1]:.0f} us (1 alert), {floor[10]:.0f} us (10 alerts)")
        print(f"{'Redis holds':34s} {'alerts/req':>10s} {'cmds/alert':>10s} {'Redis CPU us':>12s} "
              f"{'service CPU us':>14s} {'beyond floor':>12s} {'bytes/record':>12s} {'AOF B':>6s} "
              f"{'EVALSHA us':>10s} {'wall us':>8s}")
        for label, group, m in rows:
            print(f"{label:34s} {group:10d} {m['cmds']:10.1f} {m['redis_us']:12.0f} {m['svc_us']:14.0f} "
                  f"{m['svc_us'] - floor[group] / group:12.0f} {m['bytes']:12.0f} {m['aof']:6.0f} "
                  f"{m['eval_us']:10.0f} {m['wall_us']:8.0f}")
        print("per alert; AOF B: bytes appended to the AOF; EVALSHA us: time inside the scripts (commandstats), "
              "part of Redis CPU")
        print(f"{'all in (reconciler pass and history fold too)':46s} {'alerts/req':>10s} {'cmds/alert':>10s} "
              f"{'Redis CPU us':>12s} {'AOF B':>6s}")
        for label, group, m in rows:
            print(f"{label:46s} {group:10d} {m['all_cmds']:10.1f} {m['all_redis_us']:12.0f} {m['all_aof']:6.0f}")
        if fill_line:
            print(fill_line)
        mem = r.info("memory")
        history.catch_up(r)
        total = r.zcard("trainmedic:history")
        print(f"at the end: {total:,} records, used_memory {mem['used_memory'] / 2**20:.1f} MiB "
              f"({mem['used_memory'] / max(total, 1):.0f} bytes per record overall), {r.dbsize():,} keys")


if __name__ == "__main__":
    main()
