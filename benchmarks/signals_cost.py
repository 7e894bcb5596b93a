"""poll() with training signals, and the training part of GET /metrics at 10,000 jobs.

Run: .venv/bin/python benchmarks/signals_cost.py [--calls 300000] [--jobs 10000]
poll(): an idle call, a float loss every call (the detectors judge each), a 0-dim tensor loss (read once in
ten calls). /metrics: the text of the five trainmedic_training_* gauges for JOBS jobs that report signals,
then again with as many live jobs that report none and as many whose heartbeats stopped (idle targets).
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402
import torch  # noqa: E402

from trainmedic.client import RemediationClient  # noqa: E402
from trainmedic.client.wire import keys  # noqa: E402
from trainmedic.service import signals  # noqa: E402
from trainmedic.service.embedded_redis import EmbeddedRedis  # noqa: E402


def per_call_ns(fn, calls: int, repeats: int = 5) -> float:
    """Best-of-repeats mean ns per call of fn(i)."""
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for i in range(calls):
            fn(i)
        runs.append((time.perf_counter_ns() - t0) / calls)
    return min(runs)


def scrape_ms(r: redis.Redis, runs: int = 20) -> tuple[float, float, int]:
    times, size = [], 0
    for _ in range(runs):
        t0 = time.perf_counter()
        size = len(signals.metrics_text(r))
        times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    return statistics.median(times), times[int(len(times) * 0.95) - 1], size


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=300_000)
    ap.add_argument("--jobs", type=int, default=10_000)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="trainmedic-signals-"))
    server = EmbeddedRedis(tmp / "redis", appendonly=False).start()
    try:
        rc = RemediationClient(job="bench-signals", redis_url=server.url, start=False)
        rc.poll(step=0)
        poll = rc.poll
        losses = [2.0 + 0.1 * random.random() for _ in range(1024)]
        tensors = [torch.tensor(v) for v in losses]
        bare = per_call_ns(lambda i: None, args.calls)
        idle = per_call_ns(lambda i: poll(step=i), args.calls)
        with_loss = per_call_ns(lambda i: poll(step=i, loss=losses[i & 1023]), args.calls)
        with_tensor = per_call_ns(lambda i: poll(step=i, loss=tensors[i & 1023]), args.calls)
        off = RemediationClient(job="bench-signals", redis_url=server.url, start=False, detect=False)
        off.poll(step=0)
        no_detect = per_call_ns(lambda i: off.poll(step=i, loss=losses[i & 1023]), args.calls)
        print(f"poll(step=i): {idle - bare:,.0f} ns; with a float loss: {with_loss - bare:,.0f} ns "
              f"({no_detect - bare:,.0f} ns with detect=False); with a 0-dim tensor loss: {with_tensor - bare:,.0f} ns "
              f"(loop itself {bare:,.0f} ns, subtracted)")

        r = redis.Redis.from_url(server.url, decode_responses=True)
        now = time.time()
        pipe = r.pipeline(transaction=False)
        for n in range(args.jobs):
            t = keys.Target("job", f"job-{n:05d}")
            pipe.zadd(keys.live("job"), {t.label: int((now + 30) * 1000)})
            pipe.set(keys.signals(t), f"{n} {int(now * 1000)} {1.5 + n / 1e5!r} 0.0003 812.5 0.91", px=120_000)
        pipe.execute()
        p50, p95, size = scrape_ms(r)
        print(f"/metrics training gauges, {args.jobs:,} jobs reporting: p50 {p50:.1f} ms, p95 {p95:.1f} ms, "
              f"{size:,} bytes")
        pipe = r.pipeline(transaction=False)
        for n in range(args.jobs):  # live jobs that report nothing, and jobs whose heartbeats stopped long ago
            pipe.zadd(keys.live("job"), {f"job:idle-{n:05d}": int((now + 30) * 1000)})
            pipe.zadd(keys.live("job"), {f"job:gone-{n:05d}": int((now - 3600) * 1000)})
        pipe.execute()
        p50, p95, size = scrape_ms(r)
        print(f"  with {args.jobs:,} more live jobs reporting nothing and {args.jobs:,} gone: p50 {p50:.1f} ms, "
              f"p95 {p95:.1f} ms")
        r.close()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
