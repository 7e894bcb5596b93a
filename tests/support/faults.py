"""Helpers for the fault-injection tests and benchmarks: Alertmanager pushes, history reads, metric samples,
and the crash trainer (tests/e2e/crash_trainer.py) as a subprocess."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from collections.abc import Callable

import redis
import requests

from trainmedic.client.wire import keys

from tests.conftest import OP_AUTH

ROOT = Path(__file__).resolve().parents[2]
TRAINER = ROOT / "tests" / "e2e" / "crash_trainer.py"
TERMINAL = ("applied", "partially_applied", "failed", "lost", "skipped", "dry_run", "expired")


def utc(dt: datetime) -> str:
    return dt.isoformat().replace("+00:00", "Z")


def now_utc(offset: float = 0.0) -> datetime:
    return datetime.now(UTC) + timedelta(seconds=offset)


def am_alert(labels: dict, starts_at: datetime, ends_at: datetime) -> dict:
    """One alert as Prometheus posts it to Alertmanager's /api/v2/alerts."""
    return {"labels": labels, "annotations": {"summary": "fault injection"}, "startsAt": utc(starts_at),
            "endsAt": utc(ends_at)}


def am_post(am_url: str, alerts: list[dict]) -> None:
    """POST alerts to Alertmanager in one request, in order (as one Prometheus evaluation would)."""
    requests.post(am_url + "/api/v2/alerts", json=alerts, timeout=5).raise_for_status()


def am_active(am_url: str) -> list[dict]:
    """The alerts Alertmanager's API lists as active (what the reconciler asks)."""
    return list(requests.get(am_url + "/api/v2/alerts", timeout=5).json())


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, every: float = 0.1) -> Any:
    """predicate()'s first truthy value; AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


def history(url: str, **query: Any) -> list[dict]:
    """Every record GET /history lists (all pages), newest first."""
    items: list[dict] = []
    params: dict[str, Any] = {"limit": 500, **query}
    while True:
        page = requests.get(url + "/history", params=params, timeout=10).json()
        items += page["items"]
        if not page["next"]:
            return items
        params["before"] = page["next"]


def record(url: str, rid: str) -> dict:
    resp = requests.get(f"{url}/remediations/{rid}", timeout=5)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def post(url: str, path: str, body: dict) -> dict:
    """A person's write through the API (operator token); the answer."""
    resp = requests.post(url + path, json=body, headers=OP_AUTH, timeout=10)
    assert resp.status_code in (200, 201), resp.text
    return dict(resp.json())


def send(url: str, target: str, action: str, params: dict | None = None, expire_after: str = "1h") -> str:
    """One command through POST /commands (what `trainmedic send` does); its record id."""
    return str(post(url, "/commands", {"target": target, "action": action, "params": params or {},
                                       "expire_after": expire_after})["id"])


def metric(url: str, name: str, **labels: str) -> float:
    """One sample of GET /metrics (0 when absent)."""
    text = requests.get(url + "/metrics", timeout=10).text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        m = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
        if m and m.group(1) == name and ",".join(sorted((m.group(2) or "").split(","))) == want:
            return float(m.group(3))
    return 0.0


def rfc3339_seconds(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def heartbeat_pid(r: redis.Redis, target: keys.Target) -> int | None:
    raw = r.get(keys.heartbeat(target))
    return int(json.loads(raw).get("pid")) if raw else None


class CrashTrainer:
    """tests/e2e/crash_trainer.py as a subprocess: `die` takes a command and SIGKILLs itself before applying
    it; `apply` applies what it gets until told to stop."""

    def __init__(self, tmp: Path, job: str, redis_url: str, mode: str, rid: str = "", name: str = ""):
        name = name or f"{job}-{mode}-{time.monotonic_ns()}"
        self.out = tmp / f"trainer-{name}.json"
        self.stop_file = tmp / f"trainer-{name}.stop"
        self.log_path = tmp / f"trainer-{name}.log"
        self._log = open(self.log_path, "wb")
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINMEDIC_")}
        self.proc = subprocess.Popen([sys.executable, str(TRAINER), job, redis_url, str(self.out), mode, rid,
                                      str(self.stop_file)], env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=ROOT)
        self.target = keys.Target("job", job)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_beating(self, r: redis.Redis, timeout: float = 30.0) -> float:
        """Wait for this process's first heartbeat in Redis; when it was seen (time.time())."""
        def beating() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"trainer exited {self.proc.returncode}: {self.log()[-2000:]}")
            return heartbeat_pid(r, self.target) == self.pid
        wait_for(beating, timeout, f"trainer {self.pid}'s first heartbeat", every=0.02)
        return time.time()

    def result(self) -> dict:
        return dict(json.loads(self.out.read_text())) if self.out.exists() else {}

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_killed(self, timeout: float = 30.0) -> None:
        """Wait for a `die` trainer to have SIGKILLed itself after its claim."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the trainer never took the command: {self.log()[-2000:]}") from None
        assert self.proc.returncode == -signal.SIGKILL, self.log()[-2000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.stop_file.touch()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
