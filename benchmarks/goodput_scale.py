"""Goodput at scale: GET /jobs paged at 10,000 jobs (2,000 live), /metrics with 10,000 live jobs' goodput series beside
the training gauges, Redis memory per job's accounting, and the reconciler's fold per pass.

Run: .venv/bin/python benchmarks/goodput_scale.py [--jobs 10000] [--live 2000] [--rounds 3] [--scrapes 40]
The service under gunicorn (4 workers) on an embedded Redis (AOF everysec), as `trainmedic serve` runs it. Live
jobs heartbeat as training clients do (their goodput totals and training signals, every 5 s, from a thread of
this process), and the service's reconciler folds them each pass while the pages and scrapes are measured; the
other jobs ended with close() an hour before. Memory is measured on a Redis of its own holding nothing else.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import tempfile
import multiprocessing
import time
from pathlib import Path

import redis
import requests
from common import Stack, percentile

from trainmedic.client.receiver.mailbox import Mailbox
from trainmedic.client.wire import keys
from trainmedic.service import goodput, goodput_metrics, signals
from trainmedic.service.embedded_redis import EmbeddedRedis

BEAT_EVERY = 5.0


class Jobs:
    """Each job's process as its heartbeats describe it: steps of 0.1 s, a stall now and then."""

    def __init__(self, n: int, prefix: str = "bench"):
        self.names = [f"{prefix}-{i:05d}" for i in range(n)]
        self.restart(time.time() - 7200)

    def restart(self, at: float) -> None:
        """Every job's next process, begun at `at`."""
        self.started = at
        self.runs = {name: secrets.token_hex(6) for name in self.names}

    def info(self, name: str, now: float, closed: bool = False) -> dict:
        age = now - self.started
        i = int(name.rsplit("-", 1)[1])
        stall = (i % 7) * 3.0
        productive = max(0.0, age - 5 - stall)
        step = int(productive * 10)
        g = {"run": self.runs[name], "started": round(self.started, 3), "productive_s": round(productive, 3),
             "recompute_s": 0.0, "stall_s": stall, "first_step": 0, "high": step, "back": None}
        out = {"kind": "job", "name": name, "host": f"gpu-node-{i % 500:03d}", "pid": 4000 + i, "ranks": 8,
               "step": step, "sync_every": 1, "actions": ["scale_lr", "set_lr", "empty_cache"],
               "node": f"gpu-node-{i % 500:03d}", "nodes": [f"gpu-node-{i % 500:03d}"],
               "signals": {"step": step, "step_since": round(now - 0.05, 3), "loss": 2.0 + (i % 13) / 10,
                           "learning_rate": 3e-4, "samples_per_second": 512.0, "grad_norm": 1.1},
               "goodput": g, "last_seen": now}
        return {**out, "closed": True} if closed else out


def beat(r: redis.Redis, jobs: Jobs, names: list[str]) -> None:
    """Write these jobs' heartbeats now, as their clients do (mailbox.heartbeat: one round trip each)."""
    now = time.time()
    for name in names:
        Mailbox(r, keys.Target("job", name)).heartbeat(jobs.info(name, now), ttl=600)


class Beater:
    """The jobs' heartbeats, each every BEAT_EVERY seconds, spread over the interval, from a process of its own
    (not this one, whose timings it would disturb)."""

    def __init__(self, url: str, jobs: Jobs, names: list[str]):
        self.stop = multiprocessing.Event()
        self.proc = multiprocessing.Process(target=self._run, args=(url, jobs, names), daemon=True)

    def start(self) -> None:
        self.proc.start()

    def join(self) -> None:
        self.stop.set()
        self.proc.join(30)

    def _run(self, url: str, jobs: Jobs, names: list[str]) -> None:
        r = redis.Redis.from_url(url, decode_responses=True)
        chunk = max(1, len(names) // 10)
        while not self.stop.is_set():
            for start in range(0, len(names), chunk):
                beat(r, jobs, names[start:start + chunk])
                if self.stop.wait(BEAT_EVERY / 10):
                    return


def wait_folded(r: redis.Redis, live: int, timeout: float = 300) -> float:
    """Until the service's reconciler has folded `live` live jobs; how long it took."""
    t0 = time.monotonic()
    while r.zlexcount(keys.GOODPUT_JOBS, "[l:", "(l;") < live:
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"only {r.zlexcount(keys.GOODPUT_JOBS, '[l:', '(l;')} of {live} live jobs folded")
        time.sleep(0.5)
    return time.monotonic() - t0


def pages(http: requests.Session, url: str, limit: int, rounds: int) -> tuple[list[float], int]:
    """Every page of GET /jobs, `rounds` times: each page's time (ms) and how many jobs one round listed."""
    times, listed = [], 0
    for _ in range(rounds):
        cursor, listed = None, 0
        while True:
            t = time.perf_counter()
            resp = http.get(url + "/jobs", params={"limit": limit, **({"before": cursor} if cursor else {})},
                            timeout=30)
            times.append((time.perf_counter() - t) * 1000)
            resp.raise_for_status()
            body = resp.json()
            listed += len(body["items"])
            cursor = body["next"]
            if cursor is None:
                break
    return times, listed


def scrapes(http: requests.Session, url: str, n: int) -> tuple[list[float], str]:
    times, text = [], ""
    for _ in range(n):
        t = time.perf_counter()
        resp = http.get(url + "/metrics", timeout=60)
        times.append((time.perf_counter() - t) * 1000)
        resp.raise_for_status()
        text = resp.text
    return times, text


def in_process_ms(fn, n: int) -> tuple[float, float]:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times), percentile(times, 99)


def memory(jobs_n: int, live_n: int, incidents: int) -> dict[str, float]:
    """Redis memory per job's accounting (its account and its index entry), on a Redis holding nothing else."""
    tmp = Path(tempfile.mkdtemp(prefix="trainmedic-goodput-mem-"))
    server = EmbeddedRedis(tmp, appendonly=False).start()
    try:
        r = redis.Redis.from_url(server.url, decode_responses=True)
        jobs = Jobs(jobs_n, "mem")
        now = time.time()
        r.set(keys.GOODPUT_SEQ, 0)  # as after the service's first pass
        base = int(r.info("memory")["used_memory"])
        closed = jobs.names[live_n:]
        goodput.fold(r, [(keys.Target("job", n), jobs.info(n, now - 3600, closed=True)) for n in closed], now - 3600)
        goodput.fold(r, [(keys.Target("job", n), jobs.info(n, now)) for n in jobs.names[:live_n]], now)
        assert r.zlexcount(keys.GOODPUT_JOBS, "[l:", "(l;") == live_n and r.zcard(keys.GOODPUT_JOBS) == jobs_n
        used = int(r.info("memory")["used_memory"]) - base
        one = r.memory_usage(keys.goodput(keys.Target("job", jobs.names[0])))
        line = len(r.get(keys.goodput(keys.Target("job", jobs.names[0]))) or "")
        # Incidents: a job's note per remediation (record id -> highest step, recovered at).
        before = int(r.info("memory")["used_memory"])
        for n in jobs.names[:1000]:
            r.hset(keys.goodput_incidents(keys.Target("job", n)), mapping={
                f"{secrets.token_hex(13).upper()}~job~{n}": f"{12345 + k} {now:.3f}" for k in range(incidents)})
        per_incident = (int(r.info("memory")["used_memory"]) - before) / (1000 * incidents)
        return {"per_job": used / jobs_n, "account_key": float(one or 0), "line": float(line),
                "per_incident": per_incident}
    finally:
        server.stop()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--live", type=int, default=2_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scrapes", type=int, default=40)
    args = ap.parse_args()

    mem = memory(args.jobs, args.live, 10)
    with Stack(workers=4) as stack:
        r = redis.Redis.from_url(stack.redis_url, decode_responses=True)
        http = requests.Session()
        jobs = Jobs(args.jobs)
        live, rest = jobs.names[:args.live], jobs.names[args.live:]
        # The jobs that ended: each one's last heartbeat, closed, folded an hour ago.
        then = time.time() - 3600
        goodput.fold(r, [(keys.Target("job", n), jobs.info(n, then, closed=True)) for n in rest], then)
        beater = Beater(stack.redis_url, jobs, live)
        beat(r, jobs, live)
        beater.start()
        folded_in = wait_folded(r, args.live)
        time.sleep(BEAT_EVERY)  # the beats and the folds at their usual pace
        page_ms, listed = pages(http, stack.url, 100, args.rounds)
        big_ms, _ = pages(http, stack.url, 1000, args.rounds)
        first = http.get(stack.url + "/jobs", params={"limit": 1}).json()["items"][0]
        beater.join()

        # Every job live (the ended ones start again): 10,000 jobs' goodput series beside their training gauges.
        jobs.restart(time.time() - 600)
        beater = Beater(stack.redis_url, jobs, jobs.names)
        beat(r, jobs, jobs.names)
        beater.start()
        folded_all = wait_folded(r, args.jobs)
        time.sleep(BEAT_EVERY)
        scrape_ms, text = scrapes(http, stack.url, args.scrapes)
        gp_ms = in_process_ms(lambda: goodput_metrics.metrics_text(r), 20)
        sig_ms = in_process_ms(lambda: signals.metrics_text(r), 20)
        fold_ms = in_process_ms(lambda: goodput.fold_known(r, time.time()), 10)
        beater.join()

    ratio = sum(1 for ln in text.splitlines() if ln.startswith("trainmedic_job_goodput_ratio{"))
    seconds = sum(1 for ln in text.splitlines() if ln.startswith("trainmedic_job_seconds_total{"))
    loss = sum(1 for ln in text.splitlines() if ln.startswith("trainmedic_training_loss{"))
    load = os.getloadavg()[0]
    print(f"goodput at scale: {args.jobs:,} jobs, {args.live:,} live (heartbeats every {BEAT_EVERY:.0f} s, folded "
          f"by the service's reconciler each pass); gunicorn 4 workers; load average {load:.1f}")
    print(f"  first fold of {args.live:,} live jobs: {folded_in:.1f} s; of {args.jobs:,}: {folded_all:.1f} s")
    print(f"  GET /jobs, limit=100: {len(page_ms)} pages ({args.rounds} rounds of {listed:,} jobs): "
          f"p50 {statistics.median(page_ms):.1f} ms  p99 {percentile(page_ms, 99):.1f} ms  max {max(page_ms):.1f} ms"
          f"   goal p99 <= 50 ms ({'met' if percentile(page_ms, 99) <= 50 else 'NOT met'})")
    print(f"  GET /jobs, limit=1000: {len(big_ms)} pages: p50 {statistics.median(big_ms):.1f} ms  "
          f"p99 {percentile(big_ms, 99):.1f} ms")
    print(f"  a job as listed: {json.dumps(first)}")
    print(f"  GET /metrics, {args.jobs:,} live jobs ({ratio:,} goodput ratios, {seconds:,} seconds counters, {loss:,} "
          f"training losses): p50 {statistics.median(scrape_ms):.1f} ms  p99 {percentile(scrape_ms, 99):.1f} ms  "
          f"({len(text.encode()) / 1e6:.2f} MB)")
    print(f"    of which, in one process: goodput series p50 {gp_ms[0]:.1f} ms p99 {gp_ms[1]:.1f} ms; training gauges "
          f"p50 {sig_ms[0]:.1f} ms p99 {sig_ms[1]:.1f} ms   goal (goodput's share) p99 <= 50 ms "
          f"({'met' if gp_ms[1] <= 50 else 'NOT met'})")
    print(f"  the reconciler's fold, {args.jobs:,} live jobs beating: p50 {fold_ms[0]:.1f} ms p99 {fold_ms[1]:.1f} ms "
          "a pass")
    print(f"  Redis memory per job's accounting: {mem['per_job']:.0f} bytes ({args.jobs:,} jobs, {args.live:,} live: "
          f"account and index entry; one account key {mem['account_key']:.0f} bytes, its line {mem['line']:.0f} "
          f"characters)   goal <= 512 ({'met' if mem['per_job'] <= 512 else 'NOT met'})")
    print(f"  and per incident noted (its record id, the highest step, when it recovered): {mem['per_incident']:.0f} "
          "bytes, at most 100 a job")
    return 0


if __name__ == "__main__":
    sys.exit(main())
