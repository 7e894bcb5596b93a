"""The resync heals lost Redis writes: with real Alertmanager, real training loops and a redis-server that is
SIGKILLed after a burst (AOF everysec) or wiped, every firing alert ends with one applied remediation and no
LR is halved twice (Guarantees 4 and 8)."""
from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
import requests

from trainmedic.service.embedded_redis import EmbeddedRedis, free_port

from tests.conftest import TOKEN, Gunicorn
from tests.support.stack import Alertmanager

from .processes import TrainingLoop

JOBS = [f"resync-{i}" for i in range(3)]


def sigkill_and_restart_from_the_aof(server: EmbeddedRedis) -> None:
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait(10)
    server.start()


def stop_wipe_and_start_empty(server: EmbeddedRedis) -> None:
    server.stop()
    shutil.rmtree(server.data_dir)
    server.start()


def wait_for(what: str, check: Callable[[], Any], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = check()
        except (requests.RequestException, redis.RedisError):
            value = None
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("lose", [sigkill_and_restart_from_the_aof, stop_wipe_and_start_empty])
def test_every_firing_alert_ends_with_one_applied_remediation_after_redis_loses_data(
        lose: Callable[[EmbeddedRedis], None], tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis").start()  # AOF, appendfsync everysec: the default
    assert redis.Redis.from_url(server.url).config_get("appendfsync")["appendfsync"] == "everysec"
    port = free_port()
    # No resends during the test (repeat_interval 1h): only the resync can heal what Redis loses.
    am = Alertmanager(tmp_path, f"http://127.0.0.1:{port}/webhook", TOKEN, group_wait="1s", group_interval="1h",
                      repeat_interval="1h")
    g = Gunicorn({"TRAINMEDIC_REDIS_URL": server.url, "TRAINMEDIC_ALERTMANAGER_URL": am.url,
                  "TRAINMEDIC_RESYNC_AFTER": "2s"}, 2, tmp_path, port=port)
    loops = [TrainingLoop(tmp_path, job, server.url, step_seconds=0.02) for job in JOBS]
    try:
        wait_for("the training loops' heartbeats", lambda: {t["name"] for t in requests.get(
            g.url + "/targets", timeout=5).json()["targets"]} >= set(JOBS), 120)
        started = datetime.now(UTC) - timedelta(seconds=5)
        for job in JOBS:
            am.push({"alertname": "TrainingLossSpike", "job_name": job, "severity": "critical"}, starts_at=started)
        wait_for("a record per alert", lambda: len(requests.get(g.url + "/history", timeout=5).json()["items"])
                 >= len(JOBS), 30)
        lose(server)  # right after the burst: acks, cursors or records of its last second may be gone

        def healed() -> bool:
            items = requests.get(g.url + "/history", params={"limit": 100}, timeout=5).json()["items"]
            return all(any(i["target"]["name"] == job and i["status"] == "applied" for i in items) for job in JOBS)

        wait_for("one applied remediation per firing alert", healed, 90)
        time.sleep(1.0)  # more steps after the change
        results = [loop.finish() for loop in loops]
        metrics = requests.get(g.url + "/metrics", timeout=5).text
        items = requests.get(g.url + "/history", params={"limit": 100}, timeout=5).json()["items"]
    finally:
        am.stop()
        g.stop()
        for loop in loops:
            if loop.proc.poll() is None:
                loop.proc.kill()
        server.stop()

    for job, result in zip(JOBS, results):
        last = result["rows"][-1]
        # Halved exactly once, whatever Redis lost and however often the command was offered again.
        assert last["lr"] == pytest.approx(0.5 * last["scheduled"]), (job, last)
        fresh = [a for a in result["applied"] if a["action"] == "scale_lr" and a["status"] == "applied"]
        assert len(fresh) >= 1, (job, result["applied"])
    if lose is stop_wipe_and_start_empty:
        # Nothing survived: the resync decided every alert again, and the jobs answered from their own state.
        resynced = [i for i in items if i["requested_by"] == "resync"]
        assert sorted(i["target"]["name"] for i in resynced) == sorted(JOBS), items
        assert all(i["status"] == "applied" for i in resynced)
        assert "trainmedic_resynced_total 3.0" in metrics
        assert "trainmedic_redis_resets_total 1.0" in metrics
    # However the loss fell, each alert has one episode: no job has two records that both applied fresh.
    for job in JOBS:
        assert len([i for i in items if i["target"]["name"] == job and i["requested_by"] == "webhook"]) <= 1
