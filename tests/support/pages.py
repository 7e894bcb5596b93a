"""A history with every kind of record a page shows, made the real way (webhooks in, a training client acking
with real torch, the reconciler's outcome), for the layout tests and the page screenshots."""
from __future__ import annotations

import copy
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis
import torch

from trainmedic.client import RemediationClient
from trainmedic.client.wire import keys
from trainmedic.service.store import record as records

from tests.conftest import load_fixture, post_json

JOB = "llama-3-70b-instruct-finetune-v2"
NODE = "gpu-node-07.cluster.example.org"
PLAYBOOKS = """
playbooks:
  - name: loss-spike-rollback-and-halve-lr
    matchers: ['alertname="TrainingLossSpike"']
    target: job
    actions:
      - rollback_checkpoint: {}
      - scale_lr: {factor: 0.5, min_lr: 1.0e-7}
    cooldown: 1h
  - name: gpu-memory-high
    matchers: ['alertname="GPUMemoryUsageHighSustained"']
    target: job
    actions:
      - empty_cache: {}                     # skipped without CUDA
      - reduce_batch_size: {factor: 0.5, min: 1}
      - save_checkpoint: {}                 # no handler here: unsupported, so partially applied
  - name: disk-space-low
    matchers: ['alertname="DiskSpaceLow"']
    target: node
    actions:
      - disk_cleanup: {keep_last: 3, older_than: 7d}
  - name: gpu-xid-error-drain
    matchers: ['alertname="GPUXidErrorUncorrectable"']
    target: node
    approval: true
    approval_timeout: 4h
    actions:
      - drain_node: {reason: "GPU hardware error (XID 79, fallen off the bus) reported by DCGM on GPU 3"}
  - name: lr-held
    matchers: ['alertname="TrainingLossPlateau"']
    target: job
    approval: true
    actions:
      - scale_lr: {factor: 0.5}
      - save_checkpoint: {}                 # its process has no handler for it
  - name: throughput-drop
    matchers: ['alertname="TrainingThroughputDrop"']
    target: job
    actions: []
  - name: gpu-xid-checkpoint-then-drain
    matchers: ['alertname="GPUXidErrorCheckpoint"']
    target: node
    actions:
      - checkpoint_jobs: {timeout: 1m}
      - drain_node: {reason: "GPU hardware error (XID 79)"}
"""
CKPT_JOB = "gpt-neox-20b-pretrain-pile-shard-17"
CKPT_NODE = "gpu-node-12.cluster.example.org"


def alert(alertname: str, fingerprint: str, status: str = "firing", ends: str | None = None,
          **labels: str) -> dict:
    """A one-alert Alertmanager notification, its times with Alertmanager's nanoseconds."""
    body = copy.deepcopy(load_fixture("firing_single.json"))
    a = body["alerts"][0]
    a["labels"] = {"alertname": alertname, "severity": "critical", **labels}
    a["fingerprint"] = fingerprint
    a["startsAt"] = _utc(time.time() - 300)
    a["status"] = body["status"] = status
    if ends:
        a["endsAt"] = ends
    return body


def _utc(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f") + "417Z"


@contextmanager
def seeded(make_app: Any, r: redis.Redis, redis_url: str, tmp_path: Path) -> Iterator[tuple[Any, dict[str, str]]]:
    """An app and its history: the ids of an effective, a partially applied, a held (for a node that is not
    live, and for a live job that cannot apply one of its actions), a dispatched, a skipped, an action-less
    and a badly labelled record, by those names; `checkpoint` is a node record whose checkpoint_jobs step
    ended once its job acknowledged, `checkpoint_job` that job's record."""
    (tmp_path / "pb.yaml").write_text(PLAYBOOKS)
    app = make_app(playbooks=str(tmp_path / "pb.yaml"), UI_REFRESH_SECONDS=3600)
    http = app.test_client()
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    rc = RemediationClient(job=JOB, redis_url=redis_url, optimizer=opt, heartbeat_interval=0.5)
    rc.register("rollback_checkpoint", lambda params: {"restored_step": 12000, "skipped_batches": 412})
    rc.register("reduce_batch_size", lambda params: {"batch_size": 16})
    step = 0
    deadline = time.monotonic() + 10
    while not {"rollback_checkpoint", "reduce_batch_size"} <= set(
            json.loads(r.get(keys.heartbeat(keys.Target("job", JOB))) or "{}").get("actions", [])):
        assert time.monotonic() < deadline, "the heartbeat never listed the handlers"
        rc.poll(step=0)
        time.sleep(0.05)

    def fire(body: dict) -> str:
        resp = post_json(http, "/webhook", body)
        assert resp.status_code == 200, resp.get_json()
        [rec] = resp.get_json()["remediations"]
        return str(rec["id"])

    def remediate(body: dict) -> str:
        """Send an alert and train until the client has applied and acked its command."""
        nonlocal step
        rid = fire(body)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            step += 1
            rc.poll(step=step)
            if http.get(f"/remediations/{rid}").get_json()["status"] != "dispatched":
                return rid
            time.sleep(0.01)
        raise AssertionError(f"{rid} was not acked in 10 s")

    try:
        ids = {"effective": remediate(alert("TrainingLossSpike", "a1", job_name=JOB))}
        resolved = alert("TrainingLossSpike", "a1", status="resolved", ends=_utc(time.time() + 1), job_name=JOB)
        assert post_json(http, "/webhook", resolved).status_code == 200
        app.extensions["trainmedic"].reconciler.tick(time.time() + 2)
        ids["skipped"] = fire(alert("TrainingLossSpike", "a2", job_name=JOB))  # within the cooldown
        ids["partial"] = remediate(alert("GPUMemoryUsageHighSustained", "b1", job_name=JOB))
        ids["dispatched"] = fire(alert("DiskSpaceLow", "c1", node=NODE))
        ids["held"] = fire(alert("GPUXidErrorUncorrectable", "x1", node=NODE))
        ids["held_live"] = fire(alert("TrainingLossPlateau", "p1", job_name=JOB))
        ids["no_actions"] = fire(alert("TrainingThroughputDrop", "d1", job_name="bert-large-pretrain-wiki-03"))
        ids["bad_label"] = fire(alert("TrainingThroughputDrop", "e1", job_name="../../etc/passwd"))
        ids["checkpoint"], ids["checkpoint_job"] = checkpointed(app, r, redis_url)
        yield app, ids
    finally:
        rc.close()


def checkpointed(app: Any, r: redis.Redis, redis_url: str) -> tuple[str, str]:
    """A node record whose checkpoint_jobs step ended when the one job on its node saved; (its id, the job's)."""
    saved = os.environ.get("TRAINMEDIC_NODE")
    os.environ["TRAINMEDIC_NODE"] = CKPT_NODE  # the client reads its node once, when it is made
    try:
        rc = RemediationClient(job=CKPT_JOB, redis_url=redis_url, heartbeat_interval=0.5)
    finally:
        if saved is None:
            del os.environ["TRAINMEDIC_NODE"]
        else:
            os.environ["TRAINMEDIC_NODE"] = saved
    try:
        rc.register("save_checkpoint", lambda params: {"path": f"/ckpt/{CKPT_JOB}/step-4000", "step": 4000})
        beat = keys.heartbeat(keys.Target("job", CKPT_JOB))
        deadline = time.monotonic() + 10
        while "save_checkpoint" not in json.loads(r.get(beat) or "{}").get("actions", []):
            assert time.monotonic() < deadline, "the heartbeat never listed save_checkpoint"
            rc.poll(step=4000)
            time.sleep(0.05)
        resp = post_json(app.test_client(), "/webhook", alert("GPUXidErrorCheckpoint", "k1", node=CKPT_NODE))
        [rec] = resp.get_json()["remediations"]
        rid = str(rec["id"])
        deadline = time.monotonic() + 10
        while True:
            app.extensions["trainmedic"].reconciler.tick()
            rc.poll(step=4000)
            got = records.get(r, rid)
            result = (got["actions"][0]["result"] if got else None) or {}
            if result.get("waited"):
                return rid, str(result["jobs"][0]["id"])
            assert time.monotonic() < deadline, "the checkpoint step did not end in 10 s"
            time.sleep(0.05)
    finally:
        rc.close()
