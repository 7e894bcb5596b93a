"""Shared fixtures: a real redis-server per session (flushed around each test), the app, gunicorn."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import pytest
import redis
import requests

from trainmedic.client.wire.signing import Signer
from trainmedic.service.app import create_app
from trainmedic.service.embedded_redis import EmbeddedRedis, free_port

# Fixtures other test modules share: the NVML stand-in and node agents as real processes, the browser, and a
# Redis Cluster for the tests that run on both keyspaces.
pytest_plugins = ["tests.support.nvml", "tests.support.browser", "tests.support.keyspaces"]

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "alertmanager-0.25"
TOKEN = "s3cret-token"  # the webhook token (Alertmanager's)
AUTH = {"Authorization": f"Bearer {TOKEN}"}
OPERATOR = "operator-s3cret"  # the operator token (people's writes)
OP_AUTH = {"Authorization": f"Bearer {OPERATOR}"}
SIGNING_KEY = "tests-signing-key-" + "0123456789abcdef" * 2
VERIFY_KEY = Signer.from_secret(SIGNING_KEY).public
# What every service process of the tests gets (gunicorn, serve).
SERVICE_ENV = {"TRAINMEDIC_WEBHOOK_TOKEN": TOKEN, "TRAINMEDIC_OPERATOR_TOKEN": OPERATOR,
               "TRAINMEDIC_SIGNING_KEY": SIGNING_KEY}


def load_fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """Our own redis-server on a free port (never the machine's 6379)."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"), appendonly=False).start()
    yield server
    server.stop()


@pytest.fixture
def keyspace(request: pytest.FixtureRequest) -> str:
    """"single", or "cluster" for a test marked tests.support.keyspaces.BOTH in its cluster run."""
    return str(getattr(request, "param", "single"))


@pytest.fixture
def redis_url(keyspace: str, redis_server: EmbeddedRedis, request: pytest.FixtureRequest) -> str:
    if keyspace == "cluster":
        return str(request.getfixturevalue("redis_cluster").url)
    return redis_server.url


@pytest.fixture
def r(keyspace: str, redis_url: str) -> Iterator[redis.Redis]:
    cls = redis.RedisCluster if keyspace == "cluster" else redis.Redis
    client = cls.from_url(redis_url, decode_responses=True)
    client.flushall()
    yield client
    client.flushall()
    client.close()


@pytest.fixture
def make_app(r: redis.Redis, redis_url: str) -> Iterator[Any]:
    """Factory: an app on the test Redis with the shipped playbooks unless told otherwise. Its listener runs, as
    in every gunicorn worker (it hears what trainers and agents say: their heartbeats, acks and detections);
    its reconciler ticks only when a test calls tick()."""
    made: list[Any] = []

    def make(**overrides: Any) -> Any:
        config = {"TESTING": True, "redis_url": redis_url, "webhook_token": TOKEN, "operator_token": OPERATOR,
                  "signing_key": SIGNING_KEY, "playbooks": str(ROOT / "playbooks")}
        config.update(overrides)
        app = create_app(config)
        app.extensions["trainmedic"].reconciler.listener.start()
        made.append(app)
        return app
    yield make
    for app in made:
        app.extensions["trainmedic"].reconciler.listener.stop()


@pytest.fixture
def app(make_app: Any) -> Any:
    return make_app()


@pytest.fixture
def http(app: Any) -> Any:
    return app.test_client()


def post_json(http: Any, path: str, body: Any, headers: dict | None = None) -> Any:
    """POST JSON with the token that path takes (the webhook's, else the operator's) unless headers say."""
    default = AUTH if path == "/webhook" else OP_AUTH
    return http.post(path, data=json.dumps(body), content_type="application/json",
                     headers=default if headers is None else headers)


def write_playbooks(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


class Gunicorn:
    """`trainmedic`'s gunicorn config run as a real subprocess on a free port."""

    def __init__(self, env: dict[str, str], workers: int, tmp: Path, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        metrics = tmp / f"metrics-{self.port}"
        # The caller's env goes last and wins (e.g. its own TRAINMEDIC_PLAYBOOKS).
        self.env = {**os.environ, "TRAINMEDIC_BIND": f"127.0.0.1:{self.port}", "TRAINMEDIC_WORKERS": str(workers),
                    **SERVICE_ENV, "PROMETHEUS_MULTIPROC_DIR": str(metrics),
                    "TRAINMEDIC_PLAYBOOKS": str(ROOT / "playbooks"), **env}
        self.log = open(tmp / f"gunicorn-{self.port}.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "-c", str(ROOT / "service" / "gunicorn.conf.py")],
            env=self.env, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gunicorn exited: {(tmp / f'gunicorn-{self.port}.log').read_text()[-2000:]}")
            try:
                if requests.get(self.url + "/healthz", timeout=1).ok:
                    return
            except requests.RequestException:
                time.sleep(0.1)
        raise RuntimeError("gunicorn did not come up")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture
def gunicorn(r: redis.Redis, redis_url: str, tmp_path: Path) -> Iterator[Any]:
    """Factory: start the service under gunicorn with N workers (stopped after the test)."""
    started: list[Gunicorn] = []

    def start(workers: int = 4, port: int | None = None, **env: str) -> Gunicorn:
        g = Gunicorn({"TRAINMEDIC_REDIS_URL": redis_url, **env}, workers, tmp_path, port)
        started.append(g)
        return g
    yield start
    for g in started:
        g.stop()
