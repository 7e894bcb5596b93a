"""A Redis restart loses nothing under the shipped ACL file (config/redis/users.acl, rendered as Compose renders
it): redis-server with AOF, the service under gunicorn as its own user, an alert, a SIGTERM and a start from the
AOF; every record, episode, mailbox entry and cooldown is still there, and a training job with its own user
applies the command that waited. And when Redis does drop what the scripts wrote (a default user that may not
replay them, as an earlier file had it), the service counts a reset although plain writes survived."""
from __future__ import annotations

import copy
import re
import time
from pathlib import Path
from typing import Any

import requests
import torch

from trainmedic.client import RemediationClient
from trainmedic.service.embedded_redis import EmbeddedRedis, free_port

from tests.conftest import AUTH, VERIFY_KEY, Gunicorn, load_fixture
from tests.support import acl

JOB, NODE = "durable-job", "durable-node"
START = "2026-11-20T10:00:00.123456789Z"
# The default user as config/redis/users.acl had it before: only PING. Redis then refuses, when it loads the
# AOF, every transaction the scripts' writes were logged in.
RESTRICTED_DEFAULT = "user default on nopass resetkeys resetchannels -@all +ping"


def alert(starts_at: str = START) -> dict[str, Any]:
    body = copy.deepcopy(load_fixture("firing_single.json"))
    a = body["alerts"][0]
    a["labels"] = {"alertname": "TrainingLossSpike", "job_name": JOB, "severity": "critical"}
    a["fingerprint"] = "d0c0ffee00000001"
    a["startsAt"] = starts_at
    return body


def post(g: Gunicorn, body: dict[str, Any]) -> dict[str, Any]:
    resp = requests.post(g.url + "/webhook", json=body, headers=AUTH, timeout=10)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def resets(g: Gunicorn) -> float:
    text = requests.get(g.url + "/metrics", timeout=10).text
    m = re.search(r"^trainmedic_redis_resets_total (\S+)$", text, re.M)
    assert m, text[:2000]
    return float(m.group(1))


def start(data: Path, aclfile: Path, port: int) -> EmbeddedRedis:
    return EmbeddedRedis(data, port=port, extra_args=("--aclfile", str(aclfile))).start()


def test_a_restart_from_the_aof_under_the_shipped_acl_file_keeps_records_episodes_mailboxes_and_cooldowns(
        tmp_path: Path) -> None:
    aclfile = acl.render(tmp_path / "users.acl", NODE, JOB)
    port = free_port()
    srv = start(tmp_path / "data", aclfile, port)
    g = Gunicorn({"TRAINMEDIC_REDIS_URL": acl.url(port, "SERVICE", NODE, JOB)}, 1, tmp_path)
    try:
        [made] = post(g, alert())["remediations"]
        assert made["status"] == "dispatched" and made["playbook"] == "loss-spike"
        rid = made["id"]
        before = requests.get(f"{g.url}/remediations/{rid}", timeout=10).json()
        srv.stop()  # SIGTERM: Redis writes what it has and exits
        srv = start(tmp_path / "data", aclfile, port)
        assert "NOPERM" not in (tmp_path / "data" / "redis.log").read_text()
        # The record, as it was.
        got = requests.get(f"{g.url}/remediations/{rid}", timeout=10)
        assert got.status_code == 200, got.text
        assert got.json()["status"] == "dispatched" and got.json()["actions"] == before["actions"]
        # The episode: a resend of the same alert is a duplicate.
        again = post(g, alert())
        assert again["remediations"] == [] and again["duplicates"] == 1
        # The cooldown: a new episode of the alert within the playbook's 10 minutes is skipped.
        [later] = post(g, alert("2026-11-20T10:03:00Z"))["remediations"]
        assert (later["status"], later["reason"]) == ("skipped", "cooldown")
        # The mailbox: the job, with its own user, applies the command that waited through the restart.
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        rc = RemediationClient(job=JOB, redis_url=acl.url(port, "TRAINER", NODE, JOB), optimizer=opt,
                               verify_key=VERIFY_KEY)
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and opt.param_groups[0]["lr"] == 0.1:
                rc.poll(step=1)
                time.sleep(0.05)
            assert opt.param_groups[0]["lr"] == 0.05
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if requests.get(f"{g.url}/remediations/{rid}", timeout=10).json()["status"] == "applied":
                    break
                time.sleep(0.2)
            assert requests.get(f"{g.url}/remediations/{rid}", timeout=10).json()["status"] == "applied"
        finally:
            rc.close()
        assert resets(g) == 0
    finally:
        g.stop()
        srv.stop()


def test_a_reload_that_drops_what_the_scripts_wrote_is_counted_as_a_reset(tmp_path: Path) -> None:
    shipped = acl.ACL.read_text()
    assert re.search(r"^user default ", shipped, re.M)
    template = tmp_path / "restricted.acl"
    template.write_text(re.sub(r"^user default .*$", RESTRICTED_DEFAULT, shipped, flags=re.M))
    aclfile = acl.render(tmp_path / "users.acl", NODE, JOB, template=template)
    port = free_port()
    srv = start(tmp_path / "data", aclfile, port)
    g = Gunicorn({"TRAINMEDIC_REDIS_URL": acl.url(port, "SERVICE", NODE, JOB)}, 1, tmp_path)
    try:
        [made] = post(g, alert())["remediations"]
        time.sleep(2.5)  # a few reconciler passes: the mark and its copy are written
        assert resets(g) == 0
        srv.stop()
        srv = start(tmp_path / "data", aclfile, port)
        assert "NOPERM" in (tmp_path / "data" / "redis.log").read_text()
        assert requests.get(f"{g.url}/remediations/{made['id']}", timeout=10).status_code == 404
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and resets(g) == 0:
            time.sleep(0.3)
        assert resets(g) == 1
    finally:
        g.stop()
        srv.stop()
