"""Real Alertmanager and training-loop processes for end-to-end tests (and the demo)."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import requests

from service.embedded_redis import free_port

ALERTMANAGER = "/usr/bin/prometheus-alertmanager"
ROOT = Path(__file__).resolve().parents[2]

CONFIG = """\
route:
  receiver: trainmedic
  group_by: [alertname]
  group_wait: 1s
  group_interval: 2s
  repeat_interval: 2s
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


class Alertmanager:
    """Debian's prometheus-alertmanager with a config routing everything to one webhook."""

    def __init__(self, tmp: Path, webhook_url: str, token: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        conf = tmp / "alertmanager.yml"
        conf.write_text(CONFIG.format(url=webhook_url, token=token))
        self.log = open(tmp / "alertmanager.log", "wb")
        self.proc = subprocess.Popen(
            [ALERTMANAGER, f"--config.file={conf}", f"--storage.path={tmp / 'am-data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--cluster.listen-address=", "--log.level=debug"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if requests.get(self.url + "/-/ready", timeout=1).ok:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.1)
        raise RuntimeError("alertmanager did not become ready")

    def push(self, labels: dict, annotations: dict | None = None, starts_at: datetime | None = None,
             ends_in: float = 300.0) -> None:
        """POST an alert the way Prometheus does (endsAt in the future keeps it firing)."""
        starts = starts_at or datetime.now(timezone.utc)
        body = [{"labels": labels, "annotations": annotations or {},
                 "startsAt": starts.isoformat().replace("+00:00", "Z"),
                 "endsAt": (datetime.now(timezone.utc) + timedelta(seconds=ends_in)).isoformat().replace("+00:00", "Z")}]
        requests.post(self.url + "/api/v2/alerts", json=body, timeout=5).raise_for_status()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


class TrainingLoop:
    """tests/e2e/train_loop.py as a subprocess."""

    def __init__(self, tmp: Path, job: str, redis_url: str, step_seconds: float = 0.01):
        self.out = tmp / f"train-{job}.json"
        self.stop_file = tmp / f"stop-{job}"
        self.log = open(tmp / f"train-{job}.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("train_loop.py")), job, redis_url, str(self.out),
             str(self.stop_file), str(step_seconds)],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)

    def finish(self, timeout: float = 30) -> dict[str, Any]:
        self.stop_file.touch()
        self.proc.wait(timeout)
        self.log.close()
        assert self.proc.returncode == 0, (self.out.parent / self.log.name).read_text()[-2000:]
        return json.loads(self.out.read_text())
