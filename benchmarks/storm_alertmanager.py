"""Alert storm through the real Alertmanager: alerts -> Alertmanager -> webhook -> Redis -> training clients.

Run: .venv/bin/python benchmarks/storm_alertmanager.py --jobs 400 --alerts 4000
     .venv/bin/python benchmarks/storm_alertmanager.py --jobs 2000 --alerts 10000
     (--per-proc 250 --start-rate 50 --nice 10 --poll-ms 20 --idle-seconds 15 --playbooks FILE --timeout 300)

- trainmedic under gunicorn with 4 workers (common.Stack: embedded redis-server, AOF fsync everysec, commands
  signed) and benchmarks/storm_playbooks.yaml: loss-spike with only scale_lr (factor 0.5) and cooldown 0s, so
  every alert of the storm is recorded, dispatched, delivered and applied (--playbooks playbooks/ for the
  shipped ones, where a job's first alert dispatches and the rest are skipped for its cooldown);
- Debian's prometheus-alertmanager (tests/support/stack.Alertmanager: group_by [alertname, job_name, node],
  group_wait 1s; group_interval 5m and repeat_interval 4h so nothing is resent during the run), its webhook
  pointed at a small HTTP relay in front of gunicorn that stamps when each notification arrives ("send")
  and the status the service answered;
- JOBS real `RemediationClient`s, one per job, each with its own torch SGD optimizer (lr 0.1), the signing
  key's public half and its own Redis connections, as threads in processes of --per-proc clients forked
  from one server that imported torch and trainmedic once. They stand in for other machines: they run at
  nice --nice, so the service, Redis and Alertmanager come first, and start at --start-rate clients a second
  over all processes, so Redis is never flooded by connections and first heartbeats. One loop per process
  calls every client's poll() every --poll-ms;
- ALERTS `TrainingLossSpike` alerts, ALERTS/JOBS per job told apart by a `rank` label (each its own alert and
  fingerprint), POSTed to Alertmanager's API v2 in batches of 500, a job's alerts in one batch (so one
  notification a job).

Reported: the start-up (how long, how far, Redis's PING latency meanwhile); the clients' CPU while idle
(all their threads but the poll loop, per client per second) over --idle-seconds; per alert, send -> record
created and send -> applied (the client's own stamp when poll() applied it); the service's own handling
(its webhook duration histogram, and send -> answered at the relay); the CPU of the service, Redis,
Alertmanager and the clients during the storm; and exactly once per alert: one record per alert, and each
dispatched record applied by its client exactly once, its ack in the record, its job's LR halved once per
dispatched record.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import multiprocessing as mp
import os
import re
import resource
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from collections.abc import Callable

import redis
import requests

from common import ROOT, SIGNING_KEY, TOKEN, Stack, percentile
from proc_cpu import load, process_cpu, redis_cpu, thread_cpu, tree_cpu

sys.path.insert(0, str(ROOT))
from tests.support.stack import Alertmanager  # noqa: E402

LR0 = 0.1
FACTOR = 0.5  # scale_lr's factor in storm_playbooks.yaml and the shipped loss-spike playbook


def ts(rfc: str) -> float:
    return datetime.fromisoformat(rfc.replace("Z", "+00:00")).timestamp()


def raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# -- the client processes -------------------------------------------------------------------------------------
class LogCounter(logging.Handler):
    """Counts the clients' warnings by their message (a Redis timeout, ...) instead of printing them; info lines
    stay off, as in a training process that configured no logging."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: Counter[str] = Counter()
        root = logging.getLogger("trainmedic")
        root.addHandler(self)
        root.propagate = False

    def emit(self, record: logging.LogRecord) -> None:
        text = re.sub(r"\S+~(job|node)~\S+", "RECORD", record.getMessage())
        text = re.sub(r"\d+", "N", re.sub(r"storm-\d+", "JOB", text))
        self.counts[f"{record.levelname.lower()}: {text[:140]}"] += 1


def client_worker(index: int, jobs: list[str], redis_url: str, verify_key: str, poll_ms: float, rate: float,
                  nice: int, go: Any, progress: Any, stop: Any, out: Any) -> None:
    """One RemediationClient a job (threads in this process), started at `rate` a second while `go` is set (the
    parent clears it while Redis is slow to answer); one loop polls them all."""
    raise_nofile()
    os.nice(nice)
    logs = LogCounter()
    import torch

    from trainmedic.client import RemediationClient

    clients = []
    progress.put(("imported", index, 0))
    t0 = time.monotonic()
    try:
        for i, job in enumerate(jobs):
            if not go.is_set():
                go.wait()
                t0 = time.monotonic() - i / rate  # the pace goes on from here, with no burst to catch up
            opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR0)
            clients.append((job, RemediationClient(job=job, redis_url=redis_url, optimizer=opt,
                                                   verify_key=verify_key), opt))
            if i % 10 == 9:
                progress.put(("started", index, len(clients)))
            time.sleep(max(0.0, t0 + (i + 1) / rate - time.monotonic()))
    except Exception as exc:  # e.g. no more threads: say how far this process got
        progress.put(("failed", index, len(clients), f"{type(exc).__name__}: {exc}"))
    progress.put(("ready", index, len(clients)))
    applied: dict[str, list[tuple[str, str, str, float, str]]] = defaultdict(list)
    periods: list[float] = []
    step = count = told = 0
    period = poll_ms / 1000
    last = told_at = time.monotonic()
    while not stop.is_set():
        t = time.monotonic()
        periods.append(t - last)
        last = t
        for job, rc, _ in clients:
            for ack in rc.poll(step=step):
                applied[job].append((ack.record_id, ack.action, ack.status, time.time(), ack.acked_at))
                count += 1
        step += 1
        if count != told and t - told_at >= 1:
            progress.put(("applied", index, count))
            told, told_at = count, t
        time.sleep(max(0.0, period - (time.monotonic() - t)))
    lrs = {job: opt.param_groups[0]["lr"] for job, _, opt in clients}
    out.put({"applied": dict(applied), "lrs": lrs, "periods": periods[1:], "clients": len(clients),
             "logs": dict(logs.counts)})
    out.close()
    out.join_thread()
    os._exit(0)  # the clients' daemon threads need no goodbye: every ack was seen in Redis before stop


# -- the relay: stamps each notification Alertmanager sends, and the status the service answers -------------------
class Relay:
    """HTTP/1.1 pass-through (Content-Length bodies, keep-alive) in a thread with its own event loop."""

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.requests: list[dict[str, Any]] = []
        self.port = 0
        self._started = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        self._started.wait(10)
        self.url = f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        server = loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0, backlog=4096))
        self.port = server.sockets[0].getsockname()[1]
        self._started.set()
        loop.run_forever()

    @staticmethod
    async def _message(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
        head = await reader.readuntil(b"\r\n\r\n")
        m = re.search(rb"(?im)^content-length:\s*(\d+)", head)
        body = await reader.readexactly(int(m.group(1))) if m else b""
        return head, body

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                try:
                    head, body = await self._message(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                info: dict[str, Any] = {"at": time.time()}
                try:
                    doc = json.loads(body)
                    info["alerts"] = [(a["labels"].get("job_name"), a["labels"].get("rank"))
                                      for a in doc.get("alerts", [])]
                except ValueError:
                    pass
                for attempt in (0, 1):  # gunicorn closes an idle keep-alive connection: open another once
                    try:
                        if up is None:
                            up = await asyncio.open_connection("127.0.0.1", self.upstream_port)
                        up[1].write(head + body)
                        await up[1].drain()
                        rhead, rbody = await self._message(up[0])
                        break
                    except (asyncio.IncompleteReadError, ConnectionError):
                        if up is not None:
                            up[1].close()
                        up = None
                        if attempt:
                            raise
                info["status"] = int(rhead.split(b" ", 2)[1])
                info["done"] = time.time()
                self.requests.append(info)
                writer.write(rhead + rbody)
                await writer.drain()
        finally:
            writer.close()
            if up is not None:
                up[1].close()


# -- watching the run ------------------------------------------------------------------------------------------
class Pinger:
    """PINGs Redis every 100 ms on a connection of its own: how long Redis keeps a client waiting, by phase."""

    def __init__(self, url: str):
        self.r = redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=10)
        self.samples: list[tuple[float, float]] = []  # (when, ms)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            t = time.monotonic()
            try:
                self.r.ping()
                ms = (time.monotonic() - t) * 1000
            except redis.RedisError:
                ms = math.inf
            self.samples.append((t, ms))

    def between(self, t0: float, t1: float) -> list[float]:
        return [ms for t, ms in self.samples if t0 <= t < t1]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(15)


@dataclass(frozen=True)
class CPU:
    """CPU seconds used so far by each side of the run, and when they were read."""

    at: float
    clients: float  # every client process, all its threads
    polls: float  # the client processes' main threads: the poll loops
    service: float  # gunicorn's master and workers
    redis: float
    alertmanager: float
    harness: float  # this process: the relay, the PINGs, the scrapes

    @classmethod
    def read(cls, client_pids: list[int], service_pid: int, r: Any, am_pid: int) -> CPU:
        return cls(time.monotonic(), sum(process_cpu(p) for p in client_pids),
                   sum(thread_cpu(p, p) for p in client_pids), tree_cpu(service_pid), redis_cpu(r),
                   process_cpu(am_pid), time.process_time())

    def since(self, before: CPU) -> dict[str, float]:
        return {k: getattr(self, k) - getattr(before, k) for k in ("at", "clients", "polls", "service", "redis",
                                                                   "alertmanager", "harness")}


def metrics(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for attempt in range(5):  # under the storm a scrape waits behind the webhooks in gunicorn's queue
        try:
            text = requests.get(url + "/metrics", timeout=30).text
            break
        except requests.RequestException:
            if attempt == 4:
                raise
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def msum(m: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in m.items() if k == prefix or k.startswith(prefix + "{"))


def histogram_quantile(m: dict[str, float], name: str, q: float) -> float:
    """Prometheus's histogram_quantile over one histogram's buckets (linear within a bucket), in ms."""
    buckets = sorted((float(k.rpartition('le="')[2].split('"')[0]), v) for k, v in m.items()
                     if k.startswith(name + "_bucket{"))
    if not buckets or buckets[-1][1] == 0:
        return math.nan
    rank = q * buckets[-1][1]
    lo, below = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lo * 1000
            return (lo + (le - lo) * (rank - below) / max(count - below, 1e-9)) * 1000
        lo, below = le, count
    return math.nan


def history(url: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    params: dict[str, Any] = {"limit": 500}
    while True:
        for attempt in range(10):
            try:
                resp = requests.get(url + "/history", params=params, timeout=60)
                if resp.status_code == 200:
                    page = resp.json()
                    break
                # An error answer (a busy service) has no page: ask again shortly.
                if attempt == 9:
                    resp.raise_for_status()
                time.sleep(2)
            except requests.RequestException:
                if attempt == 9:
                    raise
        items += page["items"]
        if not page.get("next") or not page["items"]:
            return items
        params["before"] = page["next"]


def pct(values: list[float], p: float) -> str:
    return f"{percentile(values, p):,.0f}" if values else "-"


def pct_row(name: str, values: list[float]) -> str:
    return (f"| {name} | {len(values):,} | {pct(values, 50)} | {pct(values, 90)} | {pct(values, 99)} | "
            f"{pct(values, 100)} |")


# -- the run ---------------------------------------------------------------------------------------------------
class Clients:
    """The client processes: started together, followed through the progress they report, stopped."""

    def __init__(self, args: argparse.Namespace, jobs: list[str], redis_url: str, verify_key: str):
        ctx = mp.get_context("forkserver")
        # Imported once, in the server every client process is forked from (an optimizer's first use imports
        # torch._dynamo: seconds of CPU a process otherwise).
        ctx.set_forkserver_preload(["torch", "torch._dynamo", "trainmedic.client"])
        self.n = max(1, math.ceil(len(jobs) / args.per_proc))
        self.progress, self.out, self.stop_event, self.go = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
        self.go.set()
        self.paused = 0.0  # seconds the start was held while Redis was slow
        self.procs = [ctx.Process(target=client_worker, args=(i, jobs[i::self.n], redis_url, verify_key, args.poll_ms,
                                                              args.start_rate / self.n, args.nice, self.go,
                                                              self.progress, self.stop_event, self.out), daemon=True)
                      for i in range(self.n)]
        self.started = [0] * self.n
        self.applied = [0] * self.n
        self.imported: set[int] = set()
        self.ready: set[int] = set()
        self.errors: list[str] = []
        self.t0 = math.nan
        self.t_imported = math.nan

    def start(self) -> None:
        self.t0 = time.monotonic()
        for p in self.procs:
            p.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def drain(self) -> None:
        """Take the progress the processes reported."""
        while not self.progress.empty():
            kind, i, n, *why = self.progress.get()
            if kind == "imported":
                self.imported.add(i)
                if len(self.imported) == self.n:
                    self.t_imported = time.monotonic() - self.t0
            elif kind == "started":
                self.started[i] = n
            elif kind == "ready":
                self.started[i] = n
                self.ready.add(i)
            elif kind == "failed":
                self.errors.append(f"process {i}: {why[0]} after {n} clients")
            elif kind == "applied":
                self.applied[i] = n

    def stop(self) -> list[dict[str, Any]]:
        self.stop_event.set()
        results = []
        for _ in self.procs:
            try:
                results.append(self.out.get(timeout=120))
            except Exception:
                break
        for p in self.procs:
            if p.pid is None:
                continue
            p.join(10)
            if p.is_alive():
                p.kill()
        return results


class StartupFailed(Exception):
    """The clients did not all start and heartbeat in time."""


def wait_live(args: argparse.Namespace, clients: Clients, jobs: list[str], stack: Stack, pinger: Pinger) -> None:
    """Wait until the service sees every client live (a heartbeat), saying how far the start-up is every 5 s."""
    deadline = clients.t0 + len(jobs) / args.start_rate + args.start_grace
    last_note = last_look = clients.t0
    live = 0.0
    while True:
        clients.drain()
        # Starting clients adds connections, first heartbeats and threads: hold the start while Redis is slow.
        slow = max(pinger.between(time.monotonic() - 1, math.inf), default=0.0) > args.redis_pause_ms
        if slow:
            clients.go.clear()
            clients.paused += time.monotonic() - last_look
        else:
            clients.go.set()
        last_look = time.monotonic()
        if len(clients.ready) == clients.n:
            live = msum(metrics(stack.url), "trainmedic_targets_live")
            if live >= len(jobs):
                break
        now = time.monotonic()
        if now - last_note >= 5 or now > deadline:
            print(f"  start-up {now - clients.t0:5.0f}s: {len(clients.imported)}/{clients.n} processes up, "
                  f"{sum(clients.started):,} clients started, {len(clients.ready)}/{clients.n} processes done, "
                  f"{live:,.0f} live, held {clients.paused:.0f}s; Redis PING p99 "
                  f"{pct(pinger.between(last_note, now), 99)} ms; load {load()}", flush=True)
            last_note = now
        if now > deadline or any(p.exitcode is not None for p in clients.procs):
            raise StartupFailed(f"{sum(clients.started):,} of {len(jobs):,} clients started and {live:,.0f} live "
                                f"after {now - clients.t0:.0f}s (held {clients.paused:.0f}s while Redis was slow); "
                                f"{'; '.join(clients.errors) or 'no client raised'}; exit codes "
                                f"{[p.exitcode for p in clients.procs]}")
        time.sleep(0.25 if len(clients.ready) < clients.n else 1)
    clients.go.set()
    print(f"  the {clients.n} processes were up (torch and trainmedic imported) {clients.t_imported:.1f}s after "
          f"they were started; the start was held {clients.paused:.1f}s in all while Redis answered PING in over "
          f"{args.redis_pause_ms:.0f} ms", flush=True)


def wait_storm(args: argparse.Namespace, clients: Clients, relay: Relay, stack: Stack, pinger: Pinger,
               mark: Callable[[], CPU]) -> tuple[float, CPU]:
    """Wait until every alert is answered by the service and no command waits (its backlog), saying how far
    the storm is every 10 s; give up when nothing moved for --stall seconds, or at --timeout. Returns when the
    storm ended (the last progress seen) and the CPU then. The service's /metrics is read only once every
    notification was answered, and then every 2 s: a scrape reads every target, which under a storm of
    thousands takes the service's CPU."""
    t0 = last_note = moved = time.monotonic()
    deadline = t0 + args.timeout
    seen = (0, 0)
    ended, cpu = time.time(), mark()
    backlog = math.nan
    while True:
        clients.drain()
        answered = sum(len(q.get("alerts", [])) for q in relay.requests)
        progress = (answered, sum(clients.applied))
        now = time.monotonic()
        if progress != seen:
            seen = progress
            moved = now
            if now - cpu.at >= 1:  # the CPU at the latest progress, read at most once a second
                ended, cpu = time.time(), mark()
        if answered >= args.alerts:
            m = metrics(stack.url)
            backlog = msum(m, "trainmedic_mailbox_backlog")
            if msum(m, "trainmedic_alerts_received_total") >= args.alerts and backlog == 0:
                return time.time(), mark()
        if now - last_note >= 10:
            print(f"  storm {now - t0:5.0f}s: {answered:,} alerts answered by the service, {progress[1]:,} "
                  f"commands applied; Redis PING p99 {pct(pinger.between(last_note, now), 99)} ms; load {load()}",
                  flush=True)
            last_note = now
        if now - moved > args.stall or now > deadline:
            print(f"{'stalled' if now <= deadline else 'timed out'}: {answered:,} alerts answered, backlog "
                  f"{backlog:,.0f}, {progress[1]:,} commands applied, nothing more for {now - moved:.0f}s; the storm "
                  f"is taken to have ended at the last progress", flush=True)
            return ended, cpu
        time.sleep(2 if answered >= args.alerts else 0.2)


def fire(am: Alertmanager, jobs: list[str], per_job: int, batch: int) -> tuple[float, float]:
    """POST every job's alerts to Alertmanager, a job's alerts in one batch; returns when it began and ended."""
    alerts = [(job, k) for job in jobs for k in range(per_job)]
    ends = (datetime.now(UTC) + timedelta(hours=1)).isoformat().replace("+00:00", "Z")
    s = requests.Session()
    t0 = time.time()
    for i in range(0, len(alerts), batch):
        starts = datetime.now(UTC).isoformat().replace("+00:00", "Z")
        body = [{"labels": {"alertname": "TrainingLossSpike", "job_name": job, "severity": "critical",
                            "rank": str(k)},
                 "annotations": {"summary": f"loss spiked on {job} rank {k}"},
                 "startsAt": starts, "endsAt": ends,
                 "generatorURL": "http://prometheus:9090/graph?g0.expr=train_loss"} for job, k in alerts[i:i + batch]]
        s.post(am.url + "/api/v2/alerts", json=body, timeout=30).raise_for_status()
    return t0, time.time()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=2000)
    ap.add_argument("--alerts", type=int, default=10000, help="a multiple of --jobs")
    ap.add_argument("--per-proc", type=int, default=250, help="clients a process (default 250)")
    ap.add_argument("--start-rate", type=float, default=50.0, help="clients started a second, in all (default 50)")
    ap.add_argument("--start-grace", type=float, default=180.0,
                    help="seconds the start-up may take beyond jobs / start-rate (default 180)")
    ap.add_argument("--redis-pause-ms", type=float, default=250.0,
                    help="hold the start while a PING took longer than this in the last second (default 250)")
    ap.add_argument("--nice", type=int, default=10, help="the client processes' nice (default 10)")
    ap.add_argument("--poll-ms", type=float, default=100.0,
                    help="how often each process's loop calls every client's poll() (default 100 ms: a step)")
    ap.add_argument("--idle-seconds", type=float, default=15.0, help="the idle window measured (default 15)")
    ap.add_argument("--batch", type=int, default=500, help="alerts per POST /api/v2/alerts")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds the storm may take after the POSTs")
    ap.add_argument("--stall", type=float, default=30.0,
                    help="stop waiting once every alert was answered and nothing was applied for this long")
    ap.add_argument("--playbooks", default=str(ROOT / "benchmarks" / "storm_playbooks.yaml"))
    args = ap.parse_args()
    per_job = args.alerts // args.jobs
    if per_job < 1 or per_job * args.jobs != args.alerts or args.batch % per_job:
        sys.exit("--alerts must be a multiple of --jobs, and --batch a multiple of alerts per job")
    raise_nofile()
    from trainmedic.client.wire.signing import Signer

    verify_key = Signer.from_secret(SIGNING_KEY).public
    jobs = [f"storm-{i:05d}" for i in range(args.jobs)]
    playbooks = os.path.relpath(args.playbooks, ROOT)
    print(f"storm through Alertmanager: {args.jobs:,} jobs (one RemediationClient each, threads in processes of "
          f"{args.per_proc}, nice {args.nice}, started {args.start_rate:.0f}/s, poll() every {args.poll_ms:.0f} ms), "
          f"{args.alerts:,} TrainingLossSpike alerts ({per_job} a job); gunicorn 4 workers, Redis AOF everysec, "
          f"signed commands, playbooks {playbooks}; {os.cpu_count()} cores shared with other work")
    print(f"run {datetime.now(UTC):%Y-%m-%d %H:%M} UTC: .venv/bin/python benchmarks/storm_alertmanager.py "
          f"{' '.join(sys.argv[1:])}".rstrip())
    print(f"load average at the start: {load()}", flush=True)
    with Stack(workers=4, playbooks=args.playbooks) as stack:
        assert stack.proc is not None
        relay = Relay(stack.port)
        am = Alertmanager(stack.tmp, relay.url + "/webhook", TOKEN, group_wait="1s", group_interval="5m",
                          repeat_interval="4h")
        pinger = Pinger(stack.redis_url)
        r = redis.Redis.from_url(stack.redis_url, socket_timeout=30)
        clients = Clients(args, jobs, stack.redis_url, verify_key)
        failed = False
        try:
            clients.start()
            wait_live(args, clients, jobs, stack, pinger)
            t_start, t_live = clients.t0, time.monotonic()
            print(f"{args.jobs:,} clients in {clients.n} processes live after {t_live - t_start:.1f}s", flush=True)
            pids, service_pid, am_pid = clients.pids, stack.proc.pid, am.proc.pid

            def mark() -> CPU:
                return CPU.read(pids, service_pid, r, am_pid)

            time.sleep(5)  # the first heartbeats' reconciler visits pass
            idle0 = mark()
            time.sleep(args.idle_seconds)
            idle = mark().since(idle0)
            t_idle = time.monotonic()

            m0 = metrics(stack.url)
            storm0 = mark()
            t_fire0, t_fire1 = fire(am, jobs, per_job, args.batch)
            print(f"fired {args.alerts:,} alerts in {t_fire1 - t_fire0:.2f}s", flush=True)
            t_done, storm_end = wait_storm(args, clients, relay, stack, pinger, mark)
            storm, t_storm = storm_end.since(storm0), storm_end.at
            time.sleep(2)  # acks of the last applies reach their records
            records = history(stack.url)
            m = metrics(stack.url)
            am_metrics = requests.get(am.url + "/metrics", timeout=10).text
            results = clients.stop()
        except StartupFailed as exc:
            pings = [ms for _, ms in pinger.samples]
            print(f"the clients did not all start: {exc}")
            print(f"Redis PING during the start-up: p50 {pct(pings, 50)} ms, p99 {pct(pings, 99)} ms, "
                  f"max {pct(pings, 100)} ms")
            print(f"load average at the end: {load()}")
            for p in clients.procs:
                if p.is_alive():
                    p.kill()
            failed = True
        finally:
            pinger.stop()
            am.stop()
    if failed:
        sys.exit(1)
    load_end = load()

    # -- analysis --------------------------------------------------------------------------------------------
    client_applied: dict[str, list[tuple[str, str, str, float, str]]] = defaultdict(list)
    lrs: dict[str, float] = {}
    periods: list[float] = []
    logs: Counter[str] = Counter()
    for res in results:
        logs.update(res["logs"])
        for job, acks in res["applied"].items():
            client_applied[job] += acks
        lrs.update(res["lrs"])
        periods += res["periods"]
    sends: dict[tuple[str, str], float] = {}
    statuses: Counter[int] = Counter()
    answered: list[float] = []
    for q in relay.requests:
        statuses[q.get("status", 0)] += 1
        if "done" in q:
            answered.append((q["done"] - q["at"]) * 1000)
        for alert in q.get("alerts", []):
            sends.setdefault(tuple(alert), q["at"])

    records_of: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    dispatched_of: Counter[str] = Counter()
    for rec in records:
        if rec["target"]["kind"] == "job":
            records_of[(rec["target"]["name"], rec["alert"]["labels"].get("rank", ""))].append(rec)
    applies: dict[str, list[tuple[float, float]]] = defaultdict(list)  # record id -> (applied, poll returned)
    for acks in client_applied.values():
        for rid, action, status, returned, acked_at in acks:
            if action == "scale_lr" and status == "applied":
                applies[rid].append((ts(acked_at), returned))

    send_to_record, send_to_applied, record_to_applied, apply_to_returned = [], [], [], []
    problems: Counter[str] = Counter()
    examples: list[str] = []
    once = 0
    for job in jobs:
        for k in range(per_job):
            key = (job, str(k))
            recs = records_of.get(key, [])
            send = sends.get(key)
            why = ""
            if len(recs) != 1:
                why = f"{len(recs)} records"
            else:
                rec = recs[0]
                created = ts(rec["created_at"])
                if send is not None:
                    send_to_record.append((created - send) * 1000)
                [step] = [a for a in rec["actions"] if a["action"] == "scale_lr"] or [None]
                if step is None or step["status"] == "skipped":
                    if applies.get(rec["id"]):
                        why = "a skipped record applied"
                else:
                    dispatched_of[job] += 1
                    mine = applies.get(rec["id"], [])
                    if not mine:
                        why = f"never applied by its client (the record: {rec['status']}, scale_lr {step['status']})"
                    elif len(mine) > 1:
                        why = f"applied {len(mine)} times by its client"
                    elif step["status"] != "applied" or not step.get("acked_at"):
                        why = f"its ack is not in the record ({rec['status']}, scale_lr {step['status']})"
                    applied_at = mine[0][0] if mine else None
                    if applied_at is not None and send is not None:
                        send_to_applied.append((applied_at - send) * 1000)
                        record_to_applied.append((applied_at - created) * 1000)
                        apply_to_returned.append((mine[0][1] - applied_at) * 1000)
            if send is None:
                why = why or "never sent by Alertmanager"
            if why:
                problems[re.sub(r"\d+", "N", why)] += 1
                if len(examples) < 8:
                    examples.append(f"{job} rank {k}: {why}")
            else:
                once += 1
    lr_ok = sum(1 for job in jobs if job in lrs and math.isclose(lrs[job], LR0 * FACTOR ** dispatched_of[job],
                                                                   rel_tol=1e-9))

    fivexx = sum(v for k, v in statuses.items() if k >= 500)
    am_lines = [line for line in am_metrics.splitlines() if 'integration="webhook"' in line]
    am_failed = sum(float(x.rpartition(" ")[2]) for x in am_lines
                    if x.startswith("alertmanager_notifications_failed_total"))
    am_total = sum(float(x.rpartition(" ")[2]) for x in am_lines if x.startswith("alertmanager_notifications_total"))
    hist = "trainmedic_webhook_duration_seconds"
    dm = {k: v - m0.get(k, 0.0) for k, v in m.items() if k.startswith(hist)}
    wh_count = dm.get(hist + "_count", 0.0)
    wh_mean = dm.get(hist + "_sum", 0.0) / wh_count * 1000 if wh_count else math.nan
    n = args.jobs
    idle_bg = (idle["clients"] - idle["polls"]) * 1000 / (n * idle["at"])
    dispatched = sum(dispatched_of.values())
    record_status = Counter(rec["status"] for rec in records)
    storm_s = storm["at"]
    startup_pings = pinger.between(t_start, t_live)
    storm_pings = pinger.between(t_idle, t_storm)

    print()
    print(f"start-up: {n:,} clients live after {t_live - t_start:.1f}s; Redis PING p99 {pct(startup_pings, 99)} ms, "
          f"max {pct(startup_pings, 100)} ms (during the storm: p99 {pct(storm_pings, 99)} ms, max "
          f"{pct(storm_pings, 100)} ms)")
    print(f"idle, {idle['at']:.0f}s: clients' background CPU {idle_bg:.3f} ms/s per client (all threads but the "
          f"poll loops; goal <= 0.1), the poll loops {idle['polls'] * 1000 / (n * idle['at']):.3f} ms/s per "
          f"client; Redis {idle['redis'] * 1000 / idle['at']:.0f} ms/s, the service "
          f"{idle['service'] * 1000 / idle['at']:.0f} ms/s (CPU-ms each second, all clients together)")
    print(f"storm: fired in {t_fire1 - t_fire0:.2f}s, done {t_done - t_fire1:.1f}s after the last POST; CPU over "
          f"its {storm_s:.1f}s: service {storm['service']:.1f}s ({storm['service'] * 1e6 / args.alerts:,.0f} us an "
          f"alert), Redis {storm['redis']:.1f}s ({storm['redis'] * 1e6 / args.alerts:,.0f} us an alert), "
          f"Alertmanager {storm['alertmanager']:.1f}s, clients {storm['clients']:.1f}s ("
          f"{storm['clients'] * 1e6 / max(dispatched, 1):,.0f} us a command applied; poll loops "
          f"{storm['polls']:.1f}s), relay and harness {storm['harness']:.1f}s; {len(os.sched_getaffinity(0))} cores "
          f"x {storm_s:.1f}s = {len(os.sched_getaffinity(0)) * storm_s:.1f}s")
    print()
    print("| latency (ms) | n | p50 | p90 | p99 | max |")
    print("|---|---|---|---|---|---|")
    print(pct_row("**send -> record created** (every alert; goal p99 <= 2,000)", send_to_record))
    print(pct_row("**send -> applied** (the client's apply; goal p99 <= 5,000)", send_to_applied))
    print(pct_row("  record created -> applied", record_to_applied))
    print(pct_row("  applied -> poll() returned it (the harness's loop)", apply_to_returned))
    print(pct_row("send -> the service answered (a notification)", answered))
    print(f"| the service's webhook handling (its histogram; mean {wh_mean:,.0f}) | {wh_count:,.0f} | "
          f"{histogram_quantile(dm, hist, 0.5):,.0f} | {histogram_quantile(dm, hist, 0.9):,.0f} | "
          f"{histogram_quantile(dm, hist, 0.99):,.0f} | - |")
    print()
    polls = sorted(periods)
    print(f"poll loop period: p50 {percentile(polls, 50) * 1000:.0f} ms, p99 {percentile(polls, 99) * 1000:.0f} ms, "
          f"max {max(polls) * 1000:.0f} ms" if polls else "poll loop period: -")
    print(f"notifications: {len(relay.requests):,} through the relay, statuses {dict(statuses)}; 5xx: {fivexx}; "
          f"Alertmanager notifications_total {am_total:.0f}, notifications_failed_total {am_failed:.0f}")
    print(f"records: {len(records):,} ({dict(record_status)}); {dispatched:,} dispatched to a client; alerts "
          f"received by the service {msum(m, 'trainmedic_alerts_received_total'):,.0f}; its backlog gauge at the "
          f"end {msum(m, 'trainmedic_mailbox_backlog'):,.0f} (records still dispatched: "
          f"{record_status.get('dispatched', 0):,})")
    print(f"exactly once: {once:,}/{args.alerts:,} alerts (one record; dispatched: applied once by its client, the "
          f"ack in the record); {lr_ok:,}/{n:,} jobs' LR halved once per dispatched record")
    for why, count in problems.most_common():
        print(f"  {count:,} alerts: {why}")
    for e in examples:
        print(f"  e.g. {e}")
    print(f"the clients' warnings: {sum(logs.values()):,}" + ("" if logs else " (none)"))
    for msg, count in logs.most_common(6):
        print(f"  {count:,} x {msg}")
    print()
    met = [("send -> record p99 <= 2 s", bool(send_to_record) and percentile(send_to_record, 99) <= 2000),
           ("send -> applied p99 <= 5 s", bool(send_to_applied) and percentile(send_to_applied, 99) <= 5000),
           ("every alert exactly once", once == args.alerts and lr_ok == n), ("no 5xx", fivexx == 0 and am_failed == 0),
           ("idle client <= 0.1 ms/s", idle_bg <= 0.1)]
    print("goals: " + "; ".join(f"{g}: {'met' if ok else 'NOT met'}" for g, ok in met))
    print(f"load average at the end: {load_end}")
    (ROOT / "benchmarks" / "results").mkdir(exist_ok=True)
    (ROOT / "benchmarks" / "results" / f"storm_alertmanager_{args.jobs}.json").write_text(json.dumps({
        "jobs": args.jobs, "alerts": args.alerts, "send_to_record_ms": sorted(send_to_record),
        "send_to_applied_ms": sorted(send_to_applied), "statuses": {str(k): v for k, v in statuses.items()},
        "exactly_once": once, "idle_client_ms_per_s": idle_bg}) + "\n")


if __name__ == "__main__":
    main()
