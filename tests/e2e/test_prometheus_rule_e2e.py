"""End to end: a real Prometheus scrapes the service's /metrics, where a real training loop's loss arrives through
its heartbeat, and the shipped TrainingLossSpike rule (config/rules/training.yml, unchanged) fires on it."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import requests

from tests.support.stack import Alertmanager, Prometheus
from tests.conftest import TOKEN

from .test_alertmanager import wait_for
from .test_detections_e2e import SignalLoop

ROOT = Path(__file__).resolve().parents[2]


def query(prom: Prometheus, expr: str) -> list[dict[str, Any]]:
    body = requests.get(prom.url + "/api/v1/query", params={"query": expr}, timeout=5).json()
    return body["data"]["result"]


def test_the_shipped_loss_spike_rule_fires_on_the_services_training_loss(gunicorn, redis_url, tmp_path) -> None:
    server = gunicorn(workers=1)
    am = Alertmanager(tmp_path, server.url + "/webhook", TOKEN)
    # Scraped and evaluated every second: the rule's own `for: 20s` and 10-minute median stay as shipped.
    prom = Prometheus(tmp_path, [server.url.removeprefix("http://")], [ROOT / "config" / "rules" / "training.yml"],
                      am.url.removeprefix("http://"))
    job = "prom-spike"
    # 0.02 s steps: 40 s or more of normal losses first. The rule compares with the median of the last 10
    # minutes, so the spike must last its `for: 20s` while normal samples are still the greater part of them.
    at = 2000
    loop = SignalLoop(tmp_path, job, redis_url, "spike", at)
    try:
        # The first steps' losses are high (an untrained model) and may be the first sample scraped: wait for
        # the trained loss, as the rule's median will see it.
        normal = wait_for(lambda: [row for row in query(prom, f'trainmedic_training_loss{{job_name="{job}"}}')
                                   if float(row["value"][1]) < 5], 60, "the job's normal loss in Prometheus")
        assert normal[0]["metric"]["job_name"] == job
        spiked_at = wait_for(lambda: next((row[1] for row in loop.rows()["rows"] if row[0] == at), None), 150,
                             "the corrupt shard")

        def firing() -> dict[str, Any] | None:
            return next((a for a in prom.alerts() if a["labels"].get("alertname") == "TrainingLossSpike"
                         and a["state"] == "firing"), None)

        alert = wait_for(firing, 60, "TrainingLossSpike firing in Prometheus")
        fired_after = time.time() - spiked_at
    finally:
        loop.kill()
        prom.stop()
        am.stop()
    assert alert["labels"]["job_name"] == job and alert["labels"]["severity"] == "critical"
    assert float(alert["value"]) > 5  # the service's series, with the shard's loss
    assert 20 <= fired_after < 60  # the rule's own `for: 20s` held it pending first
