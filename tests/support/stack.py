"""Debian's Prometheus and Alertmanager as child processes on loopback, for `make demo` and end-to-end tests."""
from __future__ import annotations

import subprocess
import time
from datetime import datetime, timedelta, UTC
from pathlib import Path
from typing import IO, Any
from collections.abc import Sequence

import requests

from trainmedic.service.embedded_redis import free_port

ALERTMANAGER = "/usr/bin/prometheus-alertmanager"
PROMETHEUS = "/usr/bin/prometheus"

ALERTMANAGER_CONFIG = """\
route:
  receiver: trainmedic
  group_by: [alertname, job_name, node]
  group_wait: {group_wait}
  group_interval: {group_interval}
  repeat_interval: {repeat_interval}
receivers:
  - name: trainmedic
    webhook_configs:
      - url: {url}
        send_resolved: true
        http_config:
          authorization:
            type: Bearer
            credentials: {token}
"""


def _utc(dt: datetime) -> str:
    return dt.isoformat().replace("+00:00", "Z")


class _Child:
    """A child process with its output in a log file, stopped with SIGTERM then SIGKILL."""

    proc: subprocess.Popen
    log: IO[bytes]
    url: str

    def _spawn(self, argv: Sequence[str], log_path: Path) -> None:
        self.log_path = log_path
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(list(argv), stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)

    def _wait_ready(self, path: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.proc.args[0]} exited; see {self.log_path}")
            try:
                if requests.get(self.url + path, timeout=1).ok:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.proc.args[0]} did not become ready; see {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class Alertmanager(_Child):
    """prometheus-alertmanager routing every alert to one webhook with a bearer token (no clustering)."""

    def __init__(self, workdir: Path, webhook_url: str, token: str, group_wait: str = "1s",
                 group_interval: str = "2s", repeat_interval: str = "2s", cluster: bool = False,
                 peers: Sequence[str] = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # With cluster=True it gossips (silences, notification log) with its peers' cluster addresses.
        self.cluster_address = f"127.0.0.1:{free_port()}" if cluster else ""
        name = f"alertmanager-{self.port}" if cluster else "alertmanager"
        conf = workdir / f"{name}.yml"
        conf.write_text(ALERTMANAGER_CONFIG.format(url=webhook_url, token=token, group_wait=group_wait,
                                                   group_interval=group_interval, repeat_interval=repeat_interval))
        argv = [ALERTMANAGER, f"--config.file={conf}", f"--storage.path={workdir / (name + '-data')}",
                f"--web.listen-address=127.0.0.1:{self.port}", f"--cluster.listen-address={self.cluster_address}"]
        if cluster:
            argv += [f"--cluster.peer={p}" for p in peers] + ["--cluster.settle-timeout=2s",
                                                               "--cluster.gossip-interval=100ms",
                                                               "--cluster.pushpull-interval=2s"]
        self._spawn(argv, workdir / f"{name}.log")
        self._wait_ready("/-/ready", 30)

    def silences(self) -> list[dict[str, Any]]:
        """Every silence this Alertmanager knows (its own and its peers', through gossip)."""
        return requests.get(self.url + "/api/v2/silences", timeout=5).json()

    def resolve(self, labels: dict, starts_at: datetime) -> None:
        """POST the alert with endsAt now, as Prometheus does when a rule stops firing."""
        now = datetime.now(UTC)
        body = [{"labels": labels, "annotations": {}, "startsAt": _utc(starts_at), "endsAt": _utc(now)}]
        requests.post(self.url + "/api/v2/alerts", json=body, timeout=5).raise_for_status()

    def push(self, labels: dict, annotations: dict | None = None, starts_at: datetime | None = None,
             ends_in: float = 300.0) -> None:
        """POST an alert the way Prometheus does (endsAt in the future keeps it firing)."""
        now = datetime.now(UTC)
        body = [{"labels": labels, "annotations": annotations or {}, "startsAt": _utc(starts_at or now),
                 "endsAt": _utc(now + timedelta(seconds=ends_in))}]
        requests.post(self.url + "/api/v2/alerts", json=body, timeout=5).raise_for_status()


class Prometheus(_Child):
    """Debian's prometheus scraping the given targets every second and evaluating the given rule files."""

    def __init__(self, workdir: Path, targets: Sequence[str], rule_files: Sequence[Path], alertmanager: str,
                 port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        conf = workdir / "prometheus.yml"
        rules = "\n".join(f"  - {p}" for p in rule_files)
        scrape = ", ".join(f"'{t}'" for t in targets)
        conf.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            f"rule_files:\n{rules}\n"
            f"alerting:\n  alertmanagers:\n    - static_configs:\n        - targets: ['{alertmanager}']\n"
            f"scrape_configs:\n  - job_name: trainer\n    static_configs:\n      - targets: [{scrape}]\n")
        self._spawn([PROMETHEUS, f"--config.file={conf}", f"--storage.tsdb.path={workdir / 'prometheus-data'}",
                     f"--web.listen-address=127.0.0.1:{self.port}"], workdir / "prometheus.log")
        self._wait_ready("/-/ready", 30)

    def alerts(self) -> list[dict[str, Any]]:
        """Prometheus's own view of its alerts (pending and firing)."""
        return requests.get(self.url + "/api/v1/alerts", timeout=5).json()["data"]["alerts"]
