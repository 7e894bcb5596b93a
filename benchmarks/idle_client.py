"""What an idle training client costs in the background: its CPU per second, and what it asks of Redis.

Run: .venv/bin/python benchmarks/idle_client.py [--clients 50] [--seconds 60] [--warmup 15] [--no-service]

CLIENTS real `RemediationClient`s (each its own job, its own torch SGD optimizer and its own Redis
connections, the signing key's public half set) in this one process, started a few at a time against an
embedded redis-server (AOF everysec, as `trainmedic serve` runs it) and, unless --no-service, the service under
gunicorn (1 worker: its reconciler visits the targets and reads their heartbeats, as in production). Nothing
calls poll(): the training loop is not measured here (benchmarks/poll_cost.py does that), only what runs
beside it. After --warmup seconds (every client has sent its first heartbeat), the clients are left idle for
--seconds and measured:

- the process's CPU (time.process_time: every thread of every client; the main thread only sleeps), in
  milliseconds per second per client, and split by thread (its name with the job's name taken out), each
  thread's CPU read from /proc/self/task/<tid>/schedstat;
- Redis: its CPU (INFO cpu) per second per client, commands per second per client by name (INFO
  commandstats), bytes in and out, connections per client;
- the service's CPU (gunicorn's master and worker) over the window, for scale.

The goal for an idle client's background CPU (receiver, heartbeats) is <= 0.1 ms per second.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

from common import SIGNING_KEY, Stack
from proc_cpu import RedisMark, load, thread_cpu, tree_cpu

LR0 = 0.1


def thread_kinds(jobs: list[str]) -> dict[int, str]:
    """Native thread id -> the thread's name with its job's name taken out (what kind of thread it is)."""
    pattern = re.compile("|".join(re.escape(j) for j in sorted(jobs, key=len, reverse=True)))
    return {t.native_id: pattern.sub("JOB", t.name) for t in threading.enumerate()
            if t.native_id is not None and t is not threading.main_thread()}


def kind_cpu(kinds: dict[int, str]) -> dict[str, float]:
    pid = os.getpid()
    out: dict[str, float] = defaultdict(float)
    for tid, kind in kinds.items():
        out[kind] += thread_cpu(pid, tid)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=60.0, help="the idle window measured (default 60)")
    ap.add_argument("--warmup", type=float, default=15.0, help="seconds idle before the window (default 15)")
    ap.add_argument("--start-rate", type=float, default=50.0, help="clients started a second (default 50)")
    ap.add_argument("--no-service", action="store_true", help="Redis only: no gunicorn beside it")
    args = ap.parse_args()

    import redis
    import torch

    from trainmedic.client import RemediationClient
    from trainmedic.client.wire.signing import Signer

    verify_key = Signer.from_secret(SIGNING_KEY).public
    started = datetime.now(UTC)
    load0 = load()
    jobs = [f"idle-{i:05d}" for i in range(args.clients)]
    with Stack(workers=1, serve=not args.no_service) as stack:
        r = redis.Redis.from_url(stack.redis_url, decode_responses=True)
        threads0, conns0 = threading.active_count(), RedisMark.read(r).clients
        clients = []
        t0 = time.monotonic()
        for i, job in enumerate(jobs):
            opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR0)
            clients.append(RemediationClient(job=job, redis_url=stack.redis_url, optimizer=opt,
                                             verify_key=verify_key))
            time.sleep(max(0.0, t0 + (i + 1) / args.start_rate - time.monotonic()))
        threads = threading.active_count() - threads0
        time.sleep(args.warmup)
        kinds = thread_kinds(jobs)
        service_pid = stack.proc.pid if stack.proc is not None else None

        cpu0, wall0, k0, redis0 = time.process_time(), time.monotonic(), kind_cpu(kinds), RedisMark.read(r)
        svc0 = tree_cpu(service_pid) if service_pid else 0.0
        time.sleep(args.seconds)
        cpu1, wall1, k1, redis1 = time.process_time(), time.monotonic(), kind_cpu(kinds), RedisMark.read(r)
        svc1 = tree_cpu(service_pid) if service_pid else 0.0

        with ThreadPoolExecutor(32) as pool:  # close() waits for its threads: close them side by side
            list(pool.map(lambda c: c.close(), clients))
        r.close()
    load1 = load()

    n, span = args.clients, wall1 - wall0
    per = 1000 / (n * span)  # seconds of CPU over the window -> ms per second per client
    calls = redis1.since(redis0)
    print(f"idle clients: {n} RemediationClients (torch SGD, verify key set) in one process, "
          f"{'Redis only' if args.no_service else 'the service under gunicorn (1 worker) beside them'}; "
          f"embedded redis-server, AOF everysec; {args.warmup:.0f}s warm-up, then {span:.1f}s idle, measured")
    print(f"run {started:%Y-%m-%d %H:%M} UTC: .venv/bin/python benchmarks/idle_client.py {' '.join(sys.argv[1:])}"
          .rstrip())
    print(f"load average: {load0} at the start, {load1} at the end")
    print()
    print("| measure (per idle client) | value |")
    print("|---|---|")
    print(f"| **client CPU, all its threads (goal <= 0.1)** | **{(cpu1 - cpu0) * per:.3f} ms/s** |")
    for kind in sorted(k1, key=lambda k: -(k1[k] - k0.get(k, 0.0))):
        print(f"|   thread `{kind}` | {(k1[kind] - k0.get(kind, 0.0)) * per:.3f} ms/s |")
    print(f"| threads | {threads / n:.1f} |")
    print(f"| Redis connections | {(redis1.clients - conns0) / n:.2f} |")
    print(f"| Redis CPU | {(redis1.cpu - redis0.cpu) * per:.3f} ms/s |")
    print(f"| Redis commands | {sum(calls.values()) / (n * span):.2f} /s |")
    for name, count in list(calls.items())[:8]:
        print(f"|   {name} | {count / (n * span):.3f} /s |")
    print(f"| bytes to Redis / from Redis | {(redis1.net_in - redis0.net_in) / (n * span):,.0f} / "
          f"{(redis1.net_out - redis0.net_out) / (n * span):,.0f} B/s |")
    if not args.no_service:
        print(f"| service CPU (gunicorn, all {n} targets) | {(svc1 - svc0) * 1000 / span:.1f} ms/s in all |")


if __name__ == "__main__":
    main()
