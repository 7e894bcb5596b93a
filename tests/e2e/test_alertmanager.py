"""End to end: real Alertmanager -> webhook (bearer token) -> real PyTorch loop -> one halving, recorded."""
from __future__ import annotations

import re
import time

import requests

from tests.conftest import TOKEN
from tests.support.stack import Alertmanager

from .processes import TrainingLoop

JOB = "llama-ft-01"


def received_firing(metrics_text: str) -> float:
    m = re.search(r'^trainmedic_alerts_received_total\{status="firing"\} (\S+)$', metrics_text, re.M)
    return float(m.group(1)) if m else 0.0


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_alertmanager_resends_still_halve_the_lr_exactly_once(gunicorn, redis_url, tmp_path) -> None:
    server = gunicorn(workers=2)
    am = Alertmanager(tmp_path, server.url + "/webhook", TOKEN)
    loop = TrainingLoop(tmp_path, JOB, redis_url)
    try:
        wait_for(lambda: any(t["name"] == JOB for t in requests.get(server.url + "/targets", timeout=5)
                             .json()["targets"]), 30, "the training loop's heartbeat")
        labels = {"alertname": "TrainingLossSpike", "job_name": JOB, "severity": "critical",
                  "instance": "gpu-node-01:9445"}
        am.push(labels, {"summary": "Training loss spike detected"})
        # Keep it firing like Prometheus does, and let Alertmanager resend it (repeat_interval 2s).
        deadline = time.monotonic() + 60
        while received_firing(requests.get(server.url + "/metrics", timeout=5).text) < 4:
            assert time.monotonic() < deadline, "Alertmanager did not resend the alert"
            am.push(labels, {"summary": "Training loss spike detected"})
            time.sleep(1)
        items = wait_for(lambda: [i for i in requests.get(server.url + "/history", timeout=5).json()["items"]
                                  if i["status"] != "dispatched"], 30, "the ack")
        time.sleep(1.0)  # some more steps after the change
        result = loop.finish()
    finally:
        am.stop()
        if loop.proc.poll() is None:
            loop.proc.kill()

    history = requests.get(server.url + "/history", timeout=5).json()["items"]
    assert len(history) == 1
    [rec] = history
    assert rec["status"] == "applied" and rec["playbook"] == "loss-spike"
    scale = rec["actions"][1]
    assert scale["action"] == "scale_lr" and scale["status"] == "applied" and scale["acked_by"]
    assert scale["result"]["new_lr"][0] == scale["result"]["old_lr"][0] * 0.5

    applied = [a for a in result["applied"] if a["action"] == "scale_lr"]
    assert len(applied) == 1, "scale_lr must be applied exactly once"
    step = applied[0]["step"]
    rows = result["rows"]
    assert rows[-1]["step"] > step + 20, "the loop must run on after the change"
    for row in rows:
        ratio = row["lr"] / row["scheduled"]
        expected = 1.0 if row["step"] < step else 0.5
        assert abs(ratio - expected) < 1e-9, (row, step)
    assert items
