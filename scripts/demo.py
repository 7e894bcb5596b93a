"""`make demo`: the whole closed loop on one machine, without Docker.

Embedded Redis, the service (gunicorn) with a node agent, a toy PyTorch job (examples/train.py) that exports
its loss and LR and spikes its loss on purpose, Debian's Prometheus evaluating the shipped rules
(config/rules/*.yml) and Alertmanager calling the webhook. It waits, showing progress, until the job has
acknowledged the remediation, then prints the timeline and the history page's address.

    python scripts/demo.py            # keeps running afterwards so you can browse the page; Ctrl-C stops
    python scripts/demo.py --exit     # stops once the loop has closed (CI)

Ctrl-C, SIGTERM and SIGHUP (a closed terminal) all stop every process it started and remove its temporary
folder (kept, with the logs, when the demo failed).
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainmedic.service.embedded_redis import EmbeddedRedis, free_port  # noqa: E402
from tests.support.stack import Alertmanager, Prometheus  # noqa: E402

JOB = "demo-job"
ALERT = "TrainingLossSpike"
# The signals that stop the demo: Ctrl-C, `kill` and a closed terminal.
STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(KeyboardInterrupt):
    """Ctrl-C, SIGTERM or SIGHUP: stop every child, as Ctrl-C always did."""


class _Stops:
    """Turns the stopping signals into Stopped, held back while a child starts (see held())."""

    holding = 0
    pending: int | None = None

    @classmethod
    def handle(cls, signum: int, frame: Any) -> None:
        if cls.holding:
            cls.pending = signum
            return
        raise Stopped(signal.Signals(signum).name)


@contextmanager
def held() -> Iterator[None]:
    """Hold a stop back while a child starts, so that every child the demo starts is one it stops. (Not with
    a blocked signal mask: children would inherit it and never see their own SIGTERM.)"""
    _Stops.holding += 1
    try:
        yield
    finally:
        _Stops.holding -= 1
        if not _Stops.holding and _Stops.pending is not None:
            raise Stopped(signal.Signals(_Stops.pending).name)


def ts(rfc: str) -> float:
    return datetime.fromisoformat(rfc.replace("Z", "+00:00")).timestamp()


class Demo:
    """Every process of the closed loop, started in order and stopped in reverse."""

    def __init__(self, work: Path, args: argparse.Namespace):
        self.work = work
        self.args = args
        self.token = secrets.token_urlsafe(16)
        self.children: list[Any] = []
        self.t0 = time.time()

    def spawn(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        log = open(self.work / f"{name}.log", "wb")
        # A session of its own: a closed terminal's SIGHUP reaches the demo only, which stops it in order.
        with held():
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                                    env={**os.environ, **(env or {})}, start_new_session=True)
            self.children.append(proc)
        return proc

    def start(self) -> None:
        step("embedded Redis")
        with held():
            self.redis = EmbeddedRedis(self.work / "redis").start()
            self.children.append(self.redis)

        step("trainmedic service (gunicorn) and a node agent")
        self.port = self.args.port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.prom_port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINMEDIC_")}
        self.spawn("trainmedic", [sys.executable, "-m", "trainmedic.service.cli", "serve", "--port", str(self.port),
                                  "--workers", "2", "--redis-url", self.redis.url,
                                  "--data-dir", str(self.work / "serve")],
                   env={**env, "TRAINMEDIC_WEBHOOK_TOKEN": self.token,
                        # The pages draw the alert's metric around each remediation from it.
                        "TRAINMEDIC_PROMETHEUS_URL": f"http://127.0.0.1:{self.prom_port}"})
        wait_until(lambda: get(self.url + "/readyz") is not None, 60, "the service to be ready")

        step(f"toy training job {JOB!r} (loss spikes on purpose at step {self.args.spike_at})")
        self.metrics_port = free_port()
        self.spawn("trainer", [sys.executable, str(ROOT / "examples" / "train.py"), "--job", JOB,
                               "--redis-url", self.redis.url, "--metrics-port", str(self.metrics_port),
                               "--metrics-addr", "127.0.0.1", "--step-time", "0.02",
                               "--spike-at", str(self.args.spike_at),
                               # The demo walks the Prometheus path: rule, Alertmanager, webhook.
                               "--no-detect"])

        step("Alertmanager (Debian), routing to the webhook with a bearer token")
        with held():
            self.am = Alertmanager(self.work, self.url + "/webhook", self.token, group_wait="1s",
                                   group_interval="5s", repeat_interval="1m")
            self.children.append(self.am)

        step("Prometheus (Debian), evaluating the shipped rules every second")
        rules = sorted((ROOT / "config" / "rules").glob("*.yml"))
        rules = [r for r in rules if not r.name.startswith("test")]
        with held():
            self.prom = Prometheus(self.work, [f"127.0.0.1:{self.metrics_port}"], rules,
                                   f"127.0.0.1:{self.am.port}", port=self.prom_port)
            self.children.append(self.prom)

    def stop(self) -> None:
        for child in reversed(self.children):
            try:
                if isinstance(child, subprocess.Popen):
                    if child.poll() is None:
                        child.send_signal(signal.SIGTERM)
                        try:
                            child.wait(20)
                        except subprocess.TimeoutExpired:
                            child.kill()
                else:
                    child.stop()
            except Exception as exc:  # keep stopping the others
                print(f"  (could not stop {child}: {exc})")

    def query(self, expr: str) -> float | None:
        data = get(self.prom.url + "/api/v1/query", params={"query": expr})
        result = (data or {}).get("data", {}).get("result") or []
        return float(result[0]["value"][1]) if result else None

    def watch(self) -> dict[str, Any]:
        """Wait for the loop to close, with a progress line; returns what happened when."""
        seen: dict[str, Any] = {}
        tty = sys.stdout.isatty()
        last_print = 0.0
        deadline = time.monotonic() + self.args.timeout
        while time.monotonic() < deadline:
            now = time.time()
            loss = self.query(f'training_loss{{job_name="{JOB}"}}')
            lr = self.query(f'training_learning_rate{{job_name="{JOB}"}}')
            stepn = self.query(f'training_step{{job_name="{JOB}"}}')
            state = "-"
            for a in self.prom.alerts():
                if a["labels"].get("alertname") == ALERT:
                    state = a["state"]
                    seen.setdefault("pending_at", ts(a["activeAt"]))
                    if state == "firing":
                        seen.setdefault("firing_seen_at", now)
            page = get(self.url + "/history", params={"alertname": ALERT}) or {"items": []}
            rec = page["items"][0] if page["items"] else None
            status = rec["status"] if rec else "-"
            if rec:
                seen.setdefault("record", rec)
                seen["record"] = rec
            job = (f"step {stepn:>5.0f}  loss {loss:7.4f}  lr {lr:.2e}" if None not in (stepn, loss, lr) else
                   "waiting for the job's first metrics")
            line = f"[{now - self.t0:5.1f}s] {job:<38} | Prometheus: {state:<8} | trainmedic: {status}"
            if tty:
                print("\r" + line.ljust(100), end="", flush=True)
            elif now - last_print >= 5:
                print(line, flush=True)
                last_print = now
            if rec and status not in ("dispatched", "pending_approval"):
                if tty:
                    print()
                return seen
            time.sleep(0.25)
        if tty:
            print()
        raise TimeoutError(f"the loop did not close within {self.args.timeout:.0f}s; logs are in {self.work}")

    def verdict(self, seen: dict[str, Any]) -> dict[str, Any]:
        """After the ack: wait until trainmedic has decided whether it worked (the alert resolved, or not)."""
        rid = seen["record"]["id"]
        deadline = time.monotonic() + self.args.timeout
        print("Waiting for the outcome: did the alert resolve after the remediation?", flush=True)
        while time.monotonic() < deadline:
            rec = get(f"{self.url}/remediations/{rid}")
            outcome = (rec or {}).get("outcome") or {}
            if outcome.get("status") in ("effective", "ineffective"):
                seen["record"], seen["outcome_seen_at"] = rec, time.time()
                return seen
            time.sleep(0.25)
        print(f"  (no outcome within {self.args.timeout:.0f}s; it stays pending until the alert resolves)")
        return seen


def get(url: str, params: dict | None = None) -> Any:
    try:
        resp = requests.get(url, params=params, timeout=3)
        return resp.json() if resp.ok else None
    except (requests.RequestException, ValueError):
        return None


def wait_until(fn: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not fn():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.2)


def step(text: str) -> None:
    print(f"- starting {text}", flush=True)


def timeline(demo: Demo, seen: dict[str, Any]) -> dict[str, Any]:
    rec = seen["record"]
    scale = next((a for a in rec["actions"] if a["action"] == "scale_lr"), None)
    acked = max((ts(a["acked_at"]) for a in rec["actions"] if a["acked_at"]), default=None)
    rows = [(demo.t0, "demo started")]
    if "pending_at" in seen:
        rows.append((seen["pending_at"], f"Prometheus: {ALERT} pending (loss above twice its median)"))
    if "firing_seen_at" in seen:
        rows.append((seen["firing_seen_at"], f"Prometheus: {ALERT} firing, sent to Alertmanager"))
    rows.append((ts(rec["created_at"]), f"trainmedic: webhook accepted, remediation {rec['id']} dispatched"))
    for a in rec["actions"]:
        if a["acked_at"]:
            detail = ""
            if a["action"] == "scale_lr" and a["result"]:
                detail = f": LR {a['result']['old_lr'][0]:.3g} -> {a['result']['new_lr'][0]:.3g}"
            elif a["result"] and "restored_step" in a["result"]:
                detail = f": restored step {a['result']['restored_step']}"
            step_no = (a["result"] or {}).get("step")
            rows.append((ts(a["acked_at"]), f"{JOB}: {a['action']} {a['status']}"
                         f"{' at step ' + str(step_no) if step_no is not None else ''}{detail}"))
    outcome = rec.get("outcome") or {}
    if outcome.get("resolved_at"):
        rows.append((ts(outcome["resolved_at"]), f"Prometheus: {ALERT} resolved (Alertmanager's endsAt)"))
    if "outcome_seen_at" in seen:
        ttr = outcome.get("time_to_resolve_s")
        rows.append((seen["outcome_seen_at"], f"trainmedic: outcome {outcome['status']}"
                     + (f", {ttr:.1f}s from the last ack to the resolve" if ttr is not None else "")))
    print("\nTimeline")
    for when, what in sorted(rows):
        print(f"  +{when - demo.t0:6.1f}s  {what}")
    summary: dict[str, Any] = {"record_status": rec["status"], "record_id": rec["id"],
                               "outcome": outcome.get("status"), "time_to_resolve_s": outcome.get("time_to_resolve_s")}
    if scale and scale["result"]:
        summary["old_lr"], summary["new_lr"] = scale["result"]["old_lr"], scale["result"]["new_lr"]
        summary["scale_lr_status"] = scale["status"]
    if acked and "firing_seen_at" in seen:
        summary["alert_to_applied_s"] = round(acked - seen["firing_seen_at"], 3)
        summary["webhook_to_applied_s"] = round(acked - ts(rec["created_at"]), 3)
        print(f"\nAlert to applied (Prometheus firing -> job's ack): {summary['alert_to_applied_s']:.2f}s "
              f"(webhook -> ack {summary['webhook_to_applied_s'] * 1000:.0f} ms; firing seen by polling every 0.25 s)")
    summary["total_s"] = round(time.time() - demo.t0, 1)
    print(f"History page: {demo.url}/   (this remediation: {demo.url}/records/{rec['id']})")
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--exit", action="store_true", help="stop everything once the loop has closed")
    ap.add_argument("--summary", type=Path, help="write a JSON summary here")
    ap.add_argument("--port", type=int, default=0, help="service port (default: a free one)")
    ap.add_argument("--spike-at", type=int, default=1500, help="step at which the toy job's loss spikes")
    ap.add_argument("--timeout", type=float, default=150.0)
    args = ap.parse_args()
    for signum in STOPS:
        signal.signal(signum, _Stops.handle)
    work = Path(tempfile.mkdtemp(prefix="trainmedic-demo-"))
    print(f"trainmedic demo on {socket.gethostname()}: logs and data in {work} (removed when it stops)")
    demo = Demo(work, args)
    code = 1
    try:
        demo.start()
        print("Waiting for the loss spike, the alert, and the remediation "
              f"(the shipped {ALERT} rule holds for 20 seconds before it fires):")
        summary = timeline(demo, demo.verdict(demo.watch()))
        ok = summary.get("scale_lr_status") == "applied" and summary.get("new_lr") and \
            abs(summary["new_lr"][0] - summary["old_lr"][0] * 0.5) < 1e-12
        code = 0 if ok else 1
        if args.summary:
            args.summary.write_text(json.dumps(summary, indent=2))
        if not args.exit:
            print("The demo keeps running so you can look around; Ctrl-C stops everything.")
            while True:
                signal.pause()
    except KeyboardInterrupt:  # Stopped: Ctrl-C, SIGTERM, SIGHUP
        code = 0
    except (TimeoutError, RuntimeError, OSError) as exc:
        print(f"\ndemo failed: {exc}", file=sys.stderr)
    finally:
        for signum in STOPS:  # stopping is not interrupted: no child is left behind
            signal.signal(signum, signal.SIG_IGN)
        print("\nStopping...", flush=True)
        demo.stop()
        if code == 0:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"Logs are kept in {work}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
