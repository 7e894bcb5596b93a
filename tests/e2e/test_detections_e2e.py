"""End to end: real PyTorch loops detect a NaN, a spike and a hang; the real service remediates within steps,
and the real Alertmanager lists what was detected."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import requests

from tests.conftest import TOKEN
from tests.support.stack import Alertmanager
from trainmedic.service.embedded_redis import free_port

from .test_alertmanager import received_firing, wait_for

ROOT = Path(__file__).resolve().parents[2]


class SignalLoop:
    """tests/e2e/signal_loop.py as a subprocess (WORLD ranks over gloo)."""

    def __init__(self, tmp: Path, job: str, redis_url: str, mode: str, at: int, world: int = 1,
                 clear_after: int = 20):
        self.prefix = tmp / f"loop-{job}"
        self.stop_file = tmp / f"stop-{job}"
        self.world = world
        self.log = open(tmp / f"loop-{job}.log", "wb")
        env = {**os.environ, "MASTER_PORT": str(free_port())}
        argv = [job, redis_url, str(self.prefix), str(self.stop_file), mode, str(at), str(world), "0.02",
                str(clear_after)]
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("signal_loop.py")), *argv],
                                     stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)

    def rows(self, rank: int = 0) -> dict[str, Any]:
        try:
            return json.loads(Path(f"{self.prefix}-{rank}.json").read_text())
        except (OSError, ValueError):
            return {"rows": [], "applied": []}

    def finish(self) -> list[dict[str, Any]]:
        self.stop_file.touch()
        self.proc.wait(60)
        self.log.close()
        assert self.proc.returncode == 0, Path(self.log.name).read_text()[-3000:]
        return [self.rows(rank) for rank in range(self.world)]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()


def halved_at(rows: list[list[float]]) -> tuple[int, float]:
    """The first step (and its time) whose LR is below the first step's."""
    first = rows[0][2]
    for step, at, lr, _ in rows:
        if lr < first:
            return int(step), at
    raise AssertionError("the LR was never lowered")


def stack(gunicorn: Any, tmp_path: Path, **env: str) -> tuple[Any, Alertmanager]:
    port = free_port()
    am = Alertmanager(tmp_path, f"http://127.0.0.1:{port}/webhook", TOKEN, group_wait="1s")
    return gunicorn(workers=2, port=port, TRAINMEDIC_ALERTMANAGER_URL=am.url, **env), am


def am_alerts(am: Alertmanager, alertname: str) -> list[dict[str, Any]]:
    return [a for a in requests.get(am.url + "/api/v2/alerts", timeout=5).json()
            if a["labels"].get("alertname") == alertname]


def test_a_nan_on_one_rank_halves_the_lr_on_every_rank_within_three_steps(gunicorn, redis_url, tmp_path) -> None:
    server, am = stack(gunicorn, tmp_path)
    at = 60
    # The detection clears after 500 normal losses (10 s) instead of 20 (0.4 s): Alertmanager notifies
    # nothing of an alert that resolved within its group_wait, and the test wants to see it listed.
    loop = SignalLoop(tmp_path, "nan-job", redis_url, "nan", at, world=2, clear_after=500)
    try:
        wait_for(lambda: all(len(loop.rows(r)["rows"]) > at + 40 for r in range(2)), 90, "steps after the NaN")
        # The detection was posted to Alertmanager, which lists it and notifies the webhook of it (a resend of
        # the episode decided already).
        listed = wait_for(lambda: am_alerts(am, "TrainingLossNaN"), 10, "the NaN in Alertmanager")
        wait_for(lambda: received_firing(requests.get(server.url + "/metrics", timeout=5).text) >= 1, 15,
                 "Alertmanager's notification of the detection")
        results = loop.finish()
    finally:
        loop.kill()
        am.stop()
    nan_time = next(at_ for step, at_, _, _ in results[1]["rows"] if step == at)
    [rec] = requests.get(server.url + "/history", timeout=5).json()["items"]
    timeline = (rec["alert"]["starts_at"], rec["created_at"], rec["actions"][-1]["acked_at"])
    for res in results:
        step, when = halved_at(res["rows"])
        assert step <= at + 3, f"the LR was halved at step {step}, after the NaN at {at} ({timeline})"
        assert when - nan_time < 1.0
        lrs = {round(lr, 9) for _, _, lr, _ in res["rows"]}
        assert lrs == {0.05, 0.025}  # halved once, on every rank at the same step
    assert halved_at(results[0]["rows"])[0] == halved_at(results[1]["rows"])[0]
    assert [a["fingerprint"] for a in listed] == [rec["alert"]["fingerprint"]]
    assert rec["playbook"] == "loss-nan" and rec["requested_by"] == "detector" and rec["status"] == "applied"
    assert rec["alert"]["labels"] == {"alertname": "TrainingLossNaN", "job_name": "nan-job",
                                      "severity": "critical", "source": "trainmedic"}


def test_a_corrupt_shard_halves_the_lr_within_six_steps_and_once(gunicorn, redis_url, tmp_path) -> None:
    server, am = stack(gunicorn, tmp_path)
    at = 80
    loop = SignalLoop(tmp_path, "spike-job", redis_url, "spike", at)
    try:
        wait_for(lambda: len(loop.rows()["rows"]) > at + 60, 90, "steps after the corrupt shard")
        # The shard stays corrupt, so the detection stays on: Alertmanager lists it with the fingerprint
        # trainmedic computed, and its notification reaches the webhook as a resend, nothing new.
        listed = wait_for(lambda: am_alerts(am, "TrainingLossSpike"), 10, "the spike in Alertmanager")
        wait_for(lambda: received_firing(requests.get(server.url + "/metrics", timeout=5).text) >= 1, 15,
                 "Alertmanager's notification of the detection")
        [res] = loop.finish()
    finally:
        loop.kill()
        am.stop()
    shard_time = next(t for step, t, _, _ in res["rows"] if step == at)
    step, when = halved_at(res["rows"])
    assert step <= at + 6 and when - shard_time < 1.0, (step, when - shard_time)
    assert {round(lr, 9) for _, _, lr, _ in res["rows"]} == {0.05, 0.025}
    items = requests.get(server.url + "/history", timeout=5).json()["items"]
    assert [(i["playbook"], i["requested_by"], i["status"]) for i in items] == [
        ("loss-spike", "detector", "applied")]
    assert [a["fingerprint"] for a in listed] == [items[0]["alert"]["fingerprint"]]


def test_a_blocked_loop_raises_training_hang_and_it_resolves_when_it_moves(gunicorn, redis_url, tmp_path) -> None:
    server, am = stack(gunicorn, tmp_path, TRAINMEDIC_HANG_AFTER="5s")
    at = 30
    loop = SignalLoop(tmp_path, "hang-job", redis_url, "hang", at)
    try:
        wait_for(lambda: len(loop.rows()["rows"]) >= at - 5, 60, "the loop's first steps")
        started = time.monotonic()
        items = wait_for(lambda: requests.get(server.url + "/history", timeout=5).json()["items"], 5 + 30,
                         "the TrainingHang record")
        assert time.monotonic() - started < 5 + 30
        [rec] = items
        assert (rec["playbook"], rec["status"], rec["reason"], rec["requested_by"]) == (
            "training-hang", "skipped", "no_actions", "detector")
        assert rec["alert"]["labels"]["severity"] == "warning"
        assert am_alerts(am, "TrainingHang")
        Path(str(loop.stop_file) + ".go").touch()  # the loop moves again
        wait_for(lambda: not am_alerts(am, "TrainingHang") or all(
            a["status"]["state"] != "active" for a in am_alerts(am, "TrainingHang")), 30, "the hang to resolve")
        loop.finish()
    finally:
        loop.kill()
        am.stop()
