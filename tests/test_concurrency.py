"""Exactly once across gunicorn workers: the same alert raced through 4 workers."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import requests

from trainmedic.client.wire import keys
from trainmedic.service import history

from tests.conftest import AUTH, load_fixture


def test_the_same_payload_posted_50_times_in_parallel_gives_one_command(gunicorn, r) -> None:
    server = gunicorn(workers=4)
    body = json.dumps(load_fixture("firing_single.json"))
    headers = {**AUTH, "Content-Type": "application/json"}

    def post(_: int) -> int:
        return requests.post(server.url + "/webhook", data=body, headers=headers, timeout=10).status_code

    with ThreadPoolExecutor(16) as pool:
        codes = list(pool.map(post, range(50)))
    assert codes == [200] * 50
    assert r.xlen(keys.mailbox(keys.Target("job", "llama-ft-01"))) == 1
    history.catch_up(r)  # what a history query does before it answers
    assert r.zcard(keys.HISTORY) == 1


def test_two_alertmanager_peers_sending_one_group_give_one_command_per_alert(gunicorn, r) -> None:
    server = gunicorn(workers=4)
    body = json.dumps(load_fixture("firing_group.json"))
    headers = {**AUTH, "Content-Type": "application/json"}
    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda _: requests.post(server.url + "/webhook", data=body, headers=headers,
                                                      timeout=10).status_code, range(20)))
    assert set(codes) == {200}
    assert r.xlen(keys.mailbox(keys.Target("node", "gpu-node-01"))) == 1
    assert r.xlen(keys.mailbox(keys.Target("node", "gpu-node-02"))) == 1
