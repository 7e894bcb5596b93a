"""Shared set-up for benchmarks: an embedded Redis and the service under gunicorn, like production."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainmedic.service.embedded_redis import EmbeddedRedis, free_port

TOKEN = "bench-token"
# The service signs every command (required since commands are signed); agents and trainers take its public half.
SIGNING_KEY = "bench-signing-key-" + "0123456789abcdef" * 2


class Stack:
    """Redis (AOF on, as `trainmedic serve` runs it) plus gunicorn with N workers; a context manager."""

    def __init__(self, workers: int = 4, playbooks: str | None = None, redis_url: str | None = None,
                 env: dict[str, str] | None = None, fsync: str = "everysec", serve: bool = True):
        self.tmp = Path(tempfile.mkdtemp(prefix="trainmedic-bench-"))
        self.redis = None if redis_url else EmbeddedRedis(self.tmp / "redis", fsync=fsync)
        self.redis_url = redis_url
        self.workers = workers
        self.playbooks = playbooks or str(ROOT / "playbooks")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.extra_env = env or {}
        self.serve = serve  # False: Redis alone, no gunicorn
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Stack:
        if self.redis is not None:
            self.redis.start()
            self.redis_url = self.redis.url
        if not self.serve:
            return self
        env = dict(os.environ, TRAINMEDIC_REDIS_URL=self.redis_url, TRAINMEDIC_BIND=f"127.0.0.1:{self.port}",
                   TRAINMEDIC_WORKERS=str(self.workers), TRAINMEDIC_WEBHOOK_TOKEN=TOKEN,
                   TRAINMEDIC_PLAYBOOKS=self.playbooks, TRAINMEDIC_LOG_LEVEL="warning",
                   TRAINMEDIC_SIGNING_KEY=SIGNING_KEY, PROMETHEUS_MULTIPROC_DIR=str(self.tmp / "metrics"))
        env.update(self.extra_env)  # may override the defaults above (e.g. TRAINMEDIC_LOG_LEVEL)
        self.log = open(self.tmp / "gunicorn.log", "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "gunicorn", "-c", str(ROOT / "service/gunicorn.conf.py")],
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if requests.get(self.url + "/readyz", timeout=1).ok:
                    return self
            except requests.RequestException:
                time.sleep(0.1)
        raise RuntimeError(f"service did not start; see {self.tmp / 'gunicorn.log'}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(15)
            self.log.close()
        if self.redis is not None:
            self.redis.stop()


def percentile(values: list[float], p: float) -> float:
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))
    return s[k]
