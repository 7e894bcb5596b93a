"""poll() with training signals, and the training part of GET /metrics at 10,000 jobs.

Run: .venv/bin/python benchmarks/signals_cost.py [--calls 300000] [--jobs 10000] [--scrapes 40] [--part all]
poll(): an idle call, a float loss every call (the detectors judge each), a 0-dim tensor loss (read once in
ten calls). /metrics: the text of the five trainmedic_training_* gauges for JOBS jobs that report signals, by
the previous scrape (every live job's line parsed, then 50,000 samples formatted) and by the current one (the
index of reporting jobs, lines copied as written), alternated scrape by scrape so both see the same load; then
again with as many live jobs that report nothing and as many whose heartbeats stopped (idle targets).
"""
from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from trainmedic.client.wire import keys  # noqa: E402
from trainmedic.client.wire.protocol import SIGNALS_TTL, parse_signals, signals_line  # noqa: E402
from trainmedic.service import signals  # noqa: E402
from trainmedic.service.embedded_redis import EmbeddedRedis  # noqa: E402


def per_call_ns(fn: Callable[[int], object], calls: int, repeats: int = 5) -> float:
    """Best-of-repeats mean ns per call of fn(i)."""
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for i in range(calls):
            fn(i)
        runs.append((time.perf_counter_ns() - t0) / calls)
    return min(runs)


def previous_metrics_text(r: redis.Redis, now: float | None = None) -> bytes:
    """The scrape as it was before the index: every live job's line parsed, each sample formatted."""
    now = time.time() if now is None else now
    jobs = signals.recent_jobs(r, now, SIGNALS_TTL)
    rows = [(t, v) for t, line in zip(jobs, signals.mget(r, [keys.signals(t) for t in jobs]))
            if line and (v := parse_signals(line)) is not None]

    def number(v: float) -> str:
        return repr(v) if math.isfinite(v) else "NaN" if v != v else "+Inf" if v > 0 else "-Inf"
    out: list[str] = []
    for name, help_text, index in signals.GAUGES:
        out.append(f"# HELP {name} {help_text}\n# TYPE {name} gauge\n")
        prefix = name + '{job_name="'
        out.extend(f'{prefix}{t.name}"}} {number(x)}\n' for t, v in rows if (x := v[index]) is not None)
    return "".join(out).encode()


def series(text: bytes) -> dict[str, float]:
    """Each sample of a scrape by its series, its value read as a number (4 and 4.0 are the same sample)."""
    out = {}
    for line in text.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def scrapes_ms(r: redis.Redis, fns: dict[str, Callable[[redis.Redis], bytes]], runs: int) -> dict[str, tuple]:
    """p50 and p99 ms of each scrape function, alternated run by run, and its size."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    sizes: dict[str, int] = {}
    for _ in range(runs):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            sizes[name] = len(fn(r))
            times[name].append((time.perf_counter() - t0) * 1000)
    out = {}
    for name, ts in times.items():
        ts.sort()
        p99 = ts[min(len(ts) - 1, math.ceil(len(ts) * 0.99) - 1)]
        out[name] = (statistics.median(ts), p99, sizes[name])
    return out


def bench_poll(url: str, calls: int) -> None:
    import torch

    from trainmedic.client import RemediationClient

    rc = RemediationClient(job="bench-signals", redis_url=url, start=False)
    rc.poll(step=0)
    poll = rc.poll
    losses = [2.0 + 0.1 * random.random() for _ in range(1024)]
    tensors = [torch.tensor(v) for v in losses]
    bare = per_call_ns(lambda i: None, calls)
    idle = per_call_ns(lambda i: poll(step=i), calls)
    with_loss = per_call_ns(lambda i: poll(step=i, loss=losses[i & 1023]), calls)
    with_tensor = per_call_ns(lambda i: poll(step=i, loss=tensors[i & 1023]), calls)
    off = RemediationClient(job="bench-signals", redis_url=url, start=False, detect=False)
    off.poll(step=0)
    no_detect = per_call_ns(lambda i: off.poll(step=i, loss=losses[i & 1023]), calls)
    print(f"poll(step=i): {idle - bare:,.0f} ns; with a float loss: {with_loss - bare:,.0f} ns "
          f"({no_detect - bare:,.0f} ns with detect=False); with a 0-dim tensor loss: {with_tensor - bare:,.0f} ns "
          f"(loop itself {bare:,.0f} ns, subtracted)")


def bench_metrics(url: str, jobs: int, runs: int) -> None:
    r = redis.Redis.from_url(url, decode_responses=True)
    now = time.time()
    pipe = r.pipeline(transaction=False)
    for n in range(jobs):
        # What a heartbeat writes (client/receiver/mailbox.py): the line, the job's place in the index, and live.
        t = keys.Target("job", f"job-{n:05d}")
        line = signals_line({"step": n, "step_since": now, "loss": 1.5 + n / 1e5, "learning_rate": 0.0003,
                             "samples_per_second": 812.5, "grad_norm": 0.91})
        pipe.zadd(keys.live("job"), {t.label: int((now + 30) * 1000)})
        pipe.set(keys.signals(t), line, px=int(SIGNALS_TTL * 1000))
        pipe.zadd(keys.SIGNALS_JOBS, {t.label: int((now + SIGNALS_TTL) * 1000)})
    pipe.execute()
    fns = {"previous": previous_metrics_text, "current": signals.metrics_text}
    assert series(previous_metrics_text(r)) == series(signals.metrics_text(r))  # the same series and values
    for name, (p50, p99, size) in scrapes_ms(r, fns, runs).items():
        print(f"/metrics training gauges, {jobs:,} jobs reporting, {name}: p50 {p50:.1f} ms, p99 {p99:.1f} ms, "
              f"{size:,} bytes ({runs} scrapes)")
    pipe = r.pipeline(transaction=False)
    for n in range(jobs):  # live jobs that report nothing, and jobs whose heartbeats stopped long ago
        pipe.zadd(keys.live("job"), {f"job:idle-{n:05d}": int((now + 30) * 1000)})
        pipe.zadd(keys.live("job"), {f"job:gone-{n:05d}": int((now - 3600) * 1000)})
        pipe.zadd(keys.SIGNALS_JOBS, {f"job:gone-{n:05d}": int((now - 60) * 1000)})
    pipe.execute()
    for name, (p50, p99, _) in scrapes_ms(r, fns, runs).items():
        print(f"  with {jobs:,} more live jobs reporting nothing and {jobs:,} gone, {name}: p50 {p50:.1f} ms, "
              f"p99 {p99:.1f} ms")
    r.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=300_000)
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--scrapes", type=int, default=40)
    ap.add_argument("--part", choices=("all", "poll", "metrics"), default="all")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="trainmedic-signals-"))
    server = EmbeddedRedis(tmp / "redis", appendonly=False).start()
    try:
        if args.part in ("all", "poll"):
            bench_poll(server.url, args.calls)
        if args.part in ("all", "metrics"):
            bench_metrics(server.url, args.jobs, args.scrapes)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
