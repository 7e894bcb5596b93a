"""Redis stopped under a running service: 503 and nothing half-written; back again without a restart."""
from __future__ import annotations

import json
import time

import redis
import requests

from trainmedic.client.wire import keys
from trainmedic.service.embedded_redis import EmbeddedRedis

from tests.conftest import AUTH, load_fixture


def test_the_service_answers_503_while_redis_is_down_and_recovers(gunicorn, tmp_path) -> None:
    own = EmbeddedRedis(tmp_path / "redis").start()
    try:
        server = gunicorn(workers=2, TRAINMEDIC_REDIS_URL=own.url)
        body = json.dumps(load_fixture("firing_single.json"))
        headers = {**AUTH, "Content-Type": "application/json"}
        assert requests.get(server.url + "/readyz", timeout=5).status_code == 200
        own.stop()
        down = requests.post(server.url + "/webhook", data=body, headers=headers, timeout=10)
        assert down.status_code == 503 and down.json()["error"]
        assert requests.get(server.url + "/readyz", timeout=10).status_code == 503
        assert requests.get(server.url + "/history", timeout=10).status_code == 503
        assert requests.get(server.url + "/healthz", timeout=5).status_code == 200
        own.start()  # same port, same data dir
        deadline = time.monotonic() + 15
        while requests.get(server.url + "/readyz", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "readyz did not recover"
            time.sleep(0.2)
        up = requests.post(server.url + "/webhook", data=body, headers=headers, timeout=10)
        assert up.status_code == 200 and up.json()["remediations"][0]["status"] == "dispatched"
        r = redis.Redis.from_url(own.url, decode_responses=True)
        # The retry Alertmanager makes after the 503 is the first write: exactly one record and command.
        assert len(requests.get(server.url + "/history", timeout=10).json()["items"]) == 1
        assert r.xlen(keys.mailbox(keys.Target("job", "llama-ft-01"))) == 1
    finally:
        own.stop()
