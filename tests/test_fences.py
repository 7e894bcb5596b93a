"""Appliers that are idempotent on their own: Redis losing writes never becomes a second apply (Guarantee 4)."""
from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import pytest
import redis

from trainmedic.client.receiver.applier import Applier
from trainmedic.client.receiver.mailbox import Mailbox
from trainmedic.client.trainer import lr as lrmod
from trainmedic.client.trainer.state import AppliedState
from trainmedic.client.wire import keys
from trainmedic.service.store import record as records
from trainmedic.service import upgrade
from trainmedic.service.app import create_app
from trainmedic.service.embedded_redis import EmbeddedRedis

from tests.conftest import OPERATOR, ROOT, SIGNING_KEY, TOKEN, load_fixture, post_json, write_playbooks
from tests.support.jobs import wait_until
from tests.support.loop import Loop
from tests.support.nvml import AgentProcess, wait_record

JOB = "llama-ft-01"  # the job of the loss-spike fixture
PLAYBOOKS = """
playbooks:
  - name: halve-lr
    matchers: ['alertname="TrainingLossSpike"']
    target: job
    actions: [{scale_lr: {factor: 0.5}}]
  - name: gpu-hot
    matchers: ['alertname="GPUTemperatureHigh"']
    target: node
    actions: [{power_limit: {fraction: 0.8}}]
    on_resolved: [{restore_power_limit: {}}]
"""


@pytest.fixture
def own(tmp_path: Path) -> Iterator[tuple[EmbeddedRedis, redis.Redis, Any]]:
    """A redis-server of this test alone (no persistence but the snapshots it takes), and the service on it,
    listening to its appliers."""
    server = EmbeddedRedis(tmp_path / "redis", appendonly=False).start()
    r = redis.Redis.from_url(server.url, decode_responses=True)
    app = create_app({"TESTING": True, "redis_url": server.url, "webhook_token": TOKEN, "operator_token": OPERATOR,
                      "signing_key": SIGNING_KEY, "playbooks": str(write_playbooks(tmp_path / "pb.yaml", PLAYBOOKS))})
    listener = app.extensions["trainmedic"].reconciler.listener
    listener.start()
    yield server, r, app
    listener.stop()
    r.close()
    server.stop()


def restart_empty(server: EmbeddedRedis) -> None:
    """Restart the real redis-server with nothing on disk: what a restart without persistence leaves."""
    server.stop()
    for f in server.data_dir.rglob("*"):
        if f.is_file() and (f.suffix in (".rdb", ".aof") or "appendonly" in f.name):
            f.unlink()
    server.start()


def rejected(app: Any) -> float:
    text = app.test_client().get("/metrics").get_data(as_text=True)
    line = [x for x in text.splitlines() if x.startswith('trainmedic_commands_rejected_total{reason="replayed"}')]
    return float(line[0].split()[-1]) if line else 0.0


def test_a_redis_restored_from_a_snapshot_taken_before_the_claim_does_not_apply_twice(own: Any) -> None:
    server, r, app = own
    made = post_json(app.test_client(), "/webhook", load_fixture("firing_single.json")).get_json()
    [rid] = [m["id"] for m in made["remediations"]]
    r.save()  # the snapshot: the command is in the mailbox, nobody has claimed it
    loop = Loop(server.url, JOB)
    try:
        rec = wait_until(lambda: (lambda x: x if x and x["status"] == "applied" else None)(records.get(r, rid)),
                         tick=loop.tick, what="the first apply")
        assert loop.lr == pytest.approx(0.05)
        server.stop()
        server.start()  # back from the snapshot: the cursor and the record as they were before the claim
        # Not applied any more (the loop's receiver may already have claimed it again: delivered).
        assert records.get(r, rid)["actions"][0]["status"] in ("pending", "delivered")
        rec = wait_until(lambda: (lambda x: x if x and x["status"] == "applied" else None)(records.get(r, rid)),
                         timeout=20, tick=loop.tick, what="the command handed out again to be answered")
        loop.run_for(0.5)
    finally:
        loop.rc.close()
    assert loop.lr == pytest.approx(0.05)  # not 0.025: the client's own state fenced the repeat
    assert rec["actions"][0]["result"]["new_lr"] == [pytest.approx(0.05)]  # the earlier result, acked again
    assert [a.replayed for a in loop.acks] == [False, True]
    # Counted once, as the service folds in what the job's process said (after Redis came back).
    assert wait_until(lambda: rejected(app) == 1, what="the replay counted")


def test_a_redis_that_came_back_empty_turns_the_resend_into_a_new_record_not_a_second_apply(own: Any) -> None:
    server, r, app = own
    loop = Loop(server.url, JOB)
    body = load_fixture("firing_single.json")
    try:
        [first] = post_json(app.test_client(), "/webhook", body).get_json()["remediations"]
        wait_until(lambda: records.get(r, first["id"])["status"] == "applied", tick=loop.tick, what="the apply")
        restart_empty(server)  # restarted without persistence (a failover to an empty replica is the same)
        assert r.dbsize() == 0
        # Alertmanager's next resend of the same episode is now new to Redis: a new record.
        [again] = post_json(app.test_client(), "/webhook", copy.deepcopy(body)).get_json()["remediations"]
        assert again["id"] != first["id"] and again["status"] == "dispatched"
        rec = wait_until(lambda: (lambda x: x if x and x["status"] == "applied" else None)(records.get(r, again["id"])),
                         timeout=20, tick=loop.tick, what="the new record answered")
        loop.run_for(0.3)
    finally:
        loop.rc.close()
    assert loop.lr == pytest.approx(0.05)  # once, not 0.025: same episode, playbook and stage
    assert rec["actions"][0]["result"]["old_lr"] == [pytest.approx(0.1)]  # the first apply's result
    assert [a.replayed for a in loop.acks] == [False, True]


def test_the_agents_state_file_keeps_it_from_throttling_again_and_keeps_the_true_original(
        own: Any, nvml_lib: Path, nvml_state: Any, tmp_path: Path) -> None:
    server, r, app = own
    http = app.test_client()
    node = "gpu-node-2"
    alert = {"status": "firing", "labels": {"alertname": "GPUTemperatureHigh", "node": node, "gpu_id": "0"},
             "annotations": {}, "startsAt": "2026-11-22T01:00:00.5Z", "fingerprint": "00000000000ab001"}
    body = {"version": "4", "status": "firing", "alerts": [alert]}
    state_dir = tmp_path / "agent-state"
    agent = AgentProcess(node, server.url, tmp_path / "agent.log", lib_dir=nvml_lib, state=nvml_state,
                         state_dir=state_dir)
    try:
        agent.wait_ready(r)
        [first] = post_json(http, "/webhook", body).get_json()["remediations"]
        assert wait_record(r, first["id"])["status"] == "applied" and nvml_state.limit_w(0) == 560
        saved = json.loads((state_dir / "agent-state.json").read_text())
        assert saved["power"] == {"GPU-0a1b2c3d-0000-1111-2222-333344445555": 700_000}
        agent.stop()  # the agent restarts too: what it knows is in its state file
        restart_empty(server)  # Redis lost everything, the remembered limit included
        assert r.dbsize() == 0
        agent = AgentProcess(node, server.url, tmp_path / "agent2.log", lib_dir=nvml_lib, state=nvml_state,
                             state_dir=state_dir)
        agent.wait_ready(r)
        [again] = post_json(http, "/webhook", body).get_json()["remediations"]
        rec = wait_record(r, again["id"])
        assert rec["status"] == "applied" and rec["actions"][0]["result"]["new_watts"] == 560
        assert nvml_state.limit_w(0) == 560  # not throttled again
        resolved = {**body, "status": "resolved", "alerts": [{**alert, "status": "resolved",
                                                              "startsAt": "2026-11-22T01:00:00Z"}]}
        [undo] = post_json(http, "/webhook", resolved).get_json()["remediations"]
        rec = wait_record(r, undo["id"])
        assert rec["status"] == "applied" and rec["actions"][0]["result"]["new_watts"] == 700
        assert nvml_state.limit_w(0) == 700  # the limit from before the first throttle, not 560
        assert json.loads((state_dir / "agent-state.json").read_text())["power"] == {}
    finally:
        agent.stop()


def test_a_restarted_trainer_whose_checkpoint_shows_the_command_applied_acks_it_without_applying(own: Any) -> None:
    """Guarantee 6: delivered to a process that died before acking, offered to the next, which answers it."""
    server, r, app = own
    made = post_json(app.test_client(), "/commands", {"target": f"job:{JOB}", "action": "scale_lr",
                                                       "params": {"factor": 0.5}}).get_json()
    rid = made["id"]
    # The first process: claims, applies (its checkpoint holds that), and dies before its ack goes out.
    target = keys.Target("job", JOB)
    box = Mailbox(r, target)
    [entry] = box.fetch()
    assert box.claim(entry, "gpu-1:111") == "ok" and entry.command is not None
    state = AppliedState()
    first = Applier("job", "gpu-1:111", state)
    first.register("scale_lr", lambda inv: {"old_lr": [0.1], "new_lr": [0.05], "step": 40})
    first.apply(entry.command)
    checkpoint = state.state_dict()
    # The next process resumes from that checkpoint (its optimizer is at 0.05 already).
    loop = Loop(server.url, JOB)
    lrmod.scale_lr(loop.opt, loop.sched, 0.5)  # as restored from that checkpoint: optimizer and scheduler
    loop.rc.load_state_dict(checkpoint)
    reconciler = app.extensions["trainmedic"].reconciler
    try:
        def answered() -> Any:
            reconciler.tick(time.time() + 11)  # the reconciler's look, once the claim is old enough
            rec = records.get(r, rid)
            return rec if rec and rec["status"] == "applied" else None

        rec = wait_until(answered, timeout=20, tick=loop.tick, what="the orphaned claim offered and answered")
    finally:
        loop.rc.close()
    assert loop.lr == pytest.approx(0.05)  # not halved again
    assert rec["actions"][0]["result"] == {"old_lr": [0.1], "new_lr": [0.05], "step": 40}
    assert rec["actions"][0]["acked_by"] == loop.rc.identity and [a.replayed for a in loop.acks] == [True]


def test_shipped_helpers_have_no_leftover_keys_in_a_fresh_keyspace(own: Any) -> None:
    _, r, app = own
    # Nothing is written at start but the keyspace's identity and the mark that it holds no keys of an earlier
    # version's layout (service/upgrade.py).
    assert sorted(r.keys("*")) == sorted([keys.EPOCH, upgrade.UPGRADED])
    assert (ROOT / "playbooks" / "default.yaml").exists()
