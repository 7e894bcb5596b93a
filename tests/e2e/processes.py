"""Real Alertmanager and training-loop processes for end-to-end tests."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


ROOT = Path(__file__).resolve().parents[2]


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
