"""Alert storm through the real Alertmanager: alerts -> Alertmanager -> webhook -> Redis -> training clients.

Run: .venv/bin/python benchmarks/storm_alertmanager.py [--jobs 2000] [--alerts 10000] [--procs 8] [--poll-ms 20]

- trainmedic under gunicorn with 4 workers (common.Stack: embedded redis-server, AOF fsync everysec, the shipped
  playbooks, commands signed);
- Debian's prometheus-alertmanager (tests/support/stack.Alertmanager: group_by [alertname, job_name, node],
  group_wait 1s; group_interval 5m and repeat_interval 4h here so nothing is resent during the run), its
  webhook pointed at a small HTTP relay in front of gunicorn that stamps when each notification arrives
  (Alertmanager's send) and the status the service answered;
- JOBS real `RemediationClient`s (each with its own torch SGD optimizer, lr 0.1, the signing key's public half),
  spread over PROCS processes as threads; one loop per process calls every client's poll() every POLL_MS; the
  CPU each client process used while polling is reported, and the service side is read on its own: from
  Alertmanager's send to the record dispatched, and to the ack;
- ALERTS `TrainingLossSpike` alerts, ALERTS/JOBS per job told apart by a `rank` label (each its own alert and
  fingerprint), POSTed to Alertmanager's API v2 in batches of 500 (a job's alerts in one batch).

The shipped loss-spike playbook (rollback_checkpoint optional, scale_lr 0.5, cooldown 10m per job) dispatches
the first alert of each job and records the others `skipped` / `cooldown`. "Every job applies exactly once"
means: each job has exactly one record whose scale_lr was applied, its client applied scale_lr exactly once,
and its optimizer's LR is 0.05 (halved once) at the end.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import re
import resource
import sys
import threading
import time
from collections import Counter, defaultdict
from datetime import UTC, datetime, timedelta
from typing import Any

import requests

from common import ROOT, SIGNING_KEY, TOKEN, Stack, percentile

sys.path.insert(0, str(ROOT))
from tests.support.stack import Alertmanager  # noqa: E402

LR0 = 0.1


def ts(rfc: str) -> float:
    return datetime.fromisoformat(rfc.replace("Z", "+00:00")).timestamp()


def raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# -- the client processes -------------------------------------------------------------------------------------
def client_worker(jobs: list[str], redis_url: str, verify_key: str, poll_ms: float, ready: Any, stop: Any,
                  out: Any) -> None:
    """JOBS RemediationClients (threads) in this process; one loop polls them all every poll_ms."""
    raise_nofile()
    # The clients stand in for 2,000 machines: at nice 10 they take the CPU the service, Redis and Alertmanager
    # leave, instead of starving Redis (a Redis call that takes over 2 s is a timeout and a reconnect).
    os.nice(10)
    import torch

    from trainmedic.client import RemediationClient

    clients = []
    for i, job in enumerate(jobs):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR0)
        rc = RemediationClient(job=job, redis_url=redis_url, optimizer=opt, verify_key=verify_key)
        clients.append((job, rc, opt))
        if i % 25 == 24:
            # A start-up burst of thousands of connections and first heartbeats on 2 cores times out Redis calls
            # (2 s) and feeds on its own reconnects: start them as a cluster's jobs would, a few at a time.
            time.sleep(0.25)
    ready.put(len(clients))
    cpu0 = time.process_time()
    applied: dict[str, list[dict[str, Any]]] = defaultdict(list)
    periods: list[float] = []
    step = 0
    period = poll_ms / 1000
    last = time.monotonic()
    while not stop.is_set():
        t0 = time.monotonic()
        periods.append(t0 - last)
        last = t0
        for job, rc, _ in clients:
            for ack in rc.poll(step=step):
                applied[job].append({"record_id": ack.record_id, "action": ack.action, "status": ack.status,
                                     "at": time.time(), "acked_at": ack.acked_at})
        step += 1
        time.sleep(max(0.0, period - (time.monotonic() - t0)))
    lrs = {job: opt.param_groups[0]["lr"] for job, _, opt in clients}
    out.put({"applied": dict(applied), "lrs": lrs, "periods": periods[1:], "steps": step,
             "cpu_s": time.process_time() - cpu0, "clients": len(clients)})
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
                    info["job"] = doc.get("groupLabels", {}).get("job_name")
                    info["alerts"] = len(doc.get("alerts", []))
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


# -- the run ---------------------------------------------------------------------------------------------------
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


def history(url: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    params: dict[str, Any] = {"limit": 500}
    while True:
        for attempt in range(5):
            try:
                page = requests.get(url + "/history", params=params, timeout=60).json()
                break
            except requests.RequestException:
                if attempt == 4:
                    raise
        items += page["items"]
        if not page.get("next") or not page["items"]:
            return items
        params["before"] = page["next"]


def pct_row(name: str, values: list[float]) -> str:
    if not values:
        return f"| {name:<44} | {0:>6} | {'-':>8} | {'-':>8} | {'-':>8} | {'-':>8} |"
    return (f"| {name:<44} | {len(values):>6} | {percentile(values, 50):>8.0f} | {percentile(values, 90):>8.0f} "
            f"| {percentile(values, 99):>8.0f} | {max(values):>8.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=2000)
    ap.add_argument("--alerts", type=int, default=10000)
    ap.add_argument("--procs", type=int, default=8, help="client processes (the clients are threads in them)")
    ap.add_argument("--poll-ms", type=float, default=20.0)
    ap.add_argument("--batch", type=int, default=500, help="alerts per POST /api/v2/alerts")
    ap.add_argument("--fire-seconds", type=float, default=0.0, help="spread the POSTs over this long")
    ap.add_argument("--timeout", type=float, default=180.0)
    args = ap.parse_args()
    per_job = args.alerts // args.jobs
    assert per_job >= 1 and per_job * args.jobs == args.alerts, "--alerts must be a multiple of --jobs"
    raise_nofile()
    from trainmedic.client.wire.signing import Signer

    verify_key = Signer.from_secret(SIGNING_KEY).public
    jobs = [f"storm-{i:05d}" for i in range(args.jobs)]
    ctx = mp.get_context("spawn")
    with Stack(workers=4) as stack:
        relay = Relay(stack.port)
        am = Alertmanager(stack.tmp, relay.url + "/webhook", TOKEN, group_wait="1s", group_interval="5m",
                          repeat_interval="4h")
        ready, out, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
        procs = [ctx.Process(target=client_worker, args=(jobs[i::args.procs], stack.redis_url, verify_key,
                                                          args.poll_ms, ready, stop, out))
                 for i in range(args.procs)]
        try:
            t_start = time.monotonic()
            n = 0
            for p in procs:  # one process at a time (see client_worker)
                p.start()
                n += ready.get(timeout=300)
            # The service must see every client live (heartbeats) before the storm, so scale_lr's capability is known.
            deadline = time.monotonic() + 120
            while msum(metrics(stack.url), "trainmedic_targets_live") < args.jobs:
                assert time.monotonic() < deadline, "clients did not all heartbeat"
                time.sleep(1)
            print(f"{n} clients in {args.procs} processes live after {time.monotonic() - t_start:.1f}s", flush=True)
            time.sleep(3)  # let the first-heartbeat reconciler visits pass

            # -- the storm: a job's alerts together in one batch, so Alertmanager groups them in one notification
            alerts = [(job, k) for job in jobs for k in range(per_job)]
            fired: dict[str, float] = {}
            now = datetime.now(UTC)
            ends = (now + timedelta(hours=1)).isoformat().replace("+00:00", "Z")
            s = requests.Session()
            t_fire0 = time.time()
            for i in range(0, len(alerts), args.batch):
                chunk = alerts[i:i + args.batch]
                starts = datetime.now(UTC).isoformat().replace("+00:00", "Z")
                body = [{"labels": {"alertname": "TrainingLossSpike", "job_name": job, "severity": "critical",
                                    "rank": str(k)},
                         "annotations": {"summary": f"loss spiked on {job} rank {k}"},
                         "startsAt": starts, "endsAt": ends,
                         "generatorURL": "http://prometheus:9090/graph?g0.expr=train_loss"} for job, k in chunk]
                s.post(am.url + "/api/v2/alerts", json=body, timeout=30).raise_for_status()
                t = time.time()
                for job, _ in chunk:
                    fired.setdefault(job, t)
                time.sleep(args.fire_seconds * args.batch / len(alerts))
            t_fire1 = time.time()
            print(f"fired {len(alerts)} alerts in {t_fire1 - t_fire0:.2f}s", flush=True)

            deadline = time.monotonic() + args.timeout
            while True:
                m = metrics(stack.url)
                received = msum(m, "trainmedic_alerts_received_total")
                backlog = msum(m, "trainmedic_mailbox_backlog")
                if received >= args.alerts and backlog == 0:
                    break
                if time.monotonic() > deadline:
                    print(f"timed out: {received:.0f} alerts received, backlog {backlog:.0f}", flush=True)
                    break
                time.sleep(1)
            t_done = time.time()
            time.sleep(2)  # acks of the last applies reach their records
            records = history(stack.url)
            m = metrics(stack.url)
            am_metrics = requests.get(am.url + "/metrics", timeout=10).text
        finally:
            stop.set()
            results = []
            for _ in procs:
                try:
                    results.append(out.get(timeout=60))
                except Exception:
                    pass
            for p in procs:
                if p.pid is None:
                    continue  # never started (an earlier one was not ready in time)
                p.join(10)
                if p.is_alive():
                    p.kill()
            am.stop()

    # -- analysis --------------------------------------------------------------------------------------------
    client_applied: dict[str, list[dict[str, Any]]] = defaultdict(list)
    lrs: dict[str, float] = {}
    periods: list[float] = []
    for r in results:
        for job, acks in r["applied"].items():
            client_applied[job] += acks
        lrs.update(r["lrs"])
        periods += r["periods"]
    sends: dict[str, float] = {}
    statuses: Counter[int] = Counter()
    for q in relay.requests:
        statuses[q.get("status", 0)] += 1
        if q.get("job"):
            sends.setdefault(q["job"], q["at"])
    by_job: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rec in records:
        if rec["target"]["kind"] == "job":
            by_job[rec["target"]["name"]].append(rec)

    fire_to_send, send_to_record, record_to_ack, send_to_ack, fire_to_ack = [], [], [], [], []
    send_to_dispatched = []
    apply_to_ackseen = []
    record_status: Counter[str] = Counter(r["status"] for r in records)
    ok_jobs = 0
    problems: list[str] = []
    for job in jobs:
        recs = by_job.get(job, [])
        applied_recs = [r for r in recs if any(a["action"] == "scale_lr" and a["status"] == "applied"
                                               for a in r["actions"])]
        client_lr = [a for a in client_applied.get(job, []) if a["action"] == "scale_lr" and a["status"] == "applied"]
        lr = lrs.get(job)
        good = (len(applied_recs) == 1 and len(client_lr) == 1 and lr is not None and abs(lr - LR0 / 2) < 1e-12
                and len(recs) == per_job)
        ok_jobs += good
        if not good and len(problems) < 10:
            problems.append(f"{job}: {len(recs)} records, {len(applied_recs)} applied, client applied "
                            f"{len(client_lr)}, lr {lr}")
        send = sends.get(job)
        for r in recs:
            created = ts(r["created_at"])
            if send is not None:
                send_to_record.append((created - send) * 1000)
        if send is not None and job in fired:
            fire_to_send.append((send - fired[job]) * 1000)
        for r in applied_recs:
            if send is not None:
                send_to_dispatched.append((ts(r["created_at"]) - send) * 1000)
            acked = max(ts(a["acked_at"]) for a in r["actions"] if a.get("acked_at"))
            record_to_ack.append((acked - ts(r["created_at"])) * 1000)
            if send is not None:
                send_to_ack.append((acked - send) * 1000)
            if job in fired:
                fire_to_ack.append((acked - fired[job]) * 1000)
    for acks in client_applied.values():
        for a in acks:
            if a["action"] == "scale_lr":
                apply_to_ackseen.append((a["at"] - ts(a["acked_at"])) * 1000)

    fivexx = sum(v for k, v in statuses.items() if k >= 500)
    am_failed = sum(float(line.rpartition(" ")[2]) for line in am_metrics.splitlines()
                    if line.startswith("alertmanager_notifications_failed_total") and 'integration="webhook"' in line)
    am_total = sum(float(line.rpartition(" ")[2]) for line in am_metrics.splitlines()
                   if line.startswith("alertmanager_notifications_total") and 'integration="webhook"' in line)
    webhook_count = m.get("trainmedic_webhook_duration_seconds_count", float("nan"))
    p99_ack = percentile(send_to_ack, 99) if send_to_ack else float("inf")
    p99_dispatched = percentile(send_to_dispatched, 99) if send_to_dispatched else float("inf")
    client_cpu = [r["cpu_s"] for r in results]

    print()
    print(f"storm through Alertmanager 0.25: {args.jobs} jobs (RemediationClient threads in {args.procs} processes, "
          f"one loop per process polling every client every {args.poll_ms:.0f} ms), {args.alerts} TrainingLossSpike "
          f"alerts ({per_job} per job, `rank` label), fired in {t_fire1 - t_fire0:.2f}s in batches of {args.batch}; "
          f"gunicorn 4 workers, Redis AOF everysec, signed commands; 2 shared cores")
    print()
    print(f"| {'latency (ms)':<44} | {'n':>6} | {'p50':>8} | {'p90':>8} | {'p99':>8} | {'max':>8} |")
    print(f"|{'-' * 46}|{'-' * 8}|{'-' * 10}|{'-' * 10}|{'-' * 10}|{'-' * 10}|")
    print(pct_row("Alertmanager send -> dispatched (goal p99 <= 2000)", send_to_dispatched))
    print(pct_row("Alertmanager send -> ack (goal p99 <= 5000)", send_to_ack))
    print(pct_row("  send -> record created (every alert)", send_to_record))
    print(pct_row("  record created -> acked_at (applied)", record_to_ack))
    print(pct_row("alert POSTed -> Alertmanager send (grouping)", fire_to_send))
    print(pct_row("alert POSTed -> ack", fire_to_ack))
    print(pct_row("  apply -> poll() returned", apply_to_ackseen))
    print()
    polls = sorted(periods)
    print(f"client processes: {len(client_cpu)}, CPU while polling: {', '.join(f'{c:.1f}' for c in client_cpu)} s "
          f"(total {sum(client_cpu):.1f} s; the storm took {t_done - t_fire0:.1f} s)" if client_cpu
          else "client processes: no report")
    print(f"poll loop period: p50 {percentile(polls, 50) * 1000:.0f} ms, p99 {percentile(polls, 99) * 1000:.0f} ms, "
          f"max {max(polls) * 1000:.0f} ms" if polls else "poll loop period: -")
    print(f"notifications: {len(relay.requests)} webhook requests through the relay, statuses {dict(statuses)}; "
          f"5xx: {fivexx:.0f}; Alertmanager notifications_total {am_total:.0f}, notifications_failed_total "
          f"{am_failed:.0f}; service webhook_duration_seconds_count {webhook_count:.0f}")
    print(f"records: {len(records)} ({dict(record_status)}); alerts received by the service "
          f"{msum(m, 'trainmedic_alerts_received_total'):.0f}; done {t_done - t_fire1:.1f}s after the last POST")
    print(f"exactly once: {ok_jobs}/{args.jobs} jobs with one applied scale_lr record, one client apply and LR "
          f"{LR0} -> {LR0 / 2}")
    for p in problems:
        print("  not once:", p)
    print()
    met = [("p99 send -> dispatched <= 2 s", p99_dispatched <= 2000), ("p99 send -> ack <= 5 s", p99_ack <= 5000),
           ("no 5xx", fivexx == 0 and am_failed == 0),
           ("every job applies exactly once", ok_jobs == args.jobs)]
    print("goals: " + "; ".join(f"{g}: {'met' if ok else 'NOT met'}" for g, ok in met))
    (ROOT / "benchmarks" / "results").mkdir(exist_ok=True)
    (ROOT / "benchmarks" / "results" / f"storm_alertmanager_{args.jobs}.json").write_text(json.dumps({
        "jobs": args.jobs, "alerts": args.alerts, "send_to_ack_ms": sorted(send_to_ack),
        "statuses": {str(k): v for k, v in statuses.items()}, "ok_jobs": ok_jobs}))


if __name__ == "__main__":
    main()
