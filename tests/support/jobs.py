"""Helpers for training-side tests: job playbooks, sending through the service, waiting for acks."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import redis

from trainmedic.service.decide import dispatch
from trainmedic.service import history
from trainmedic.service.rules.alerts import parse_alert
from trainmedic.service.rules.playbooks import Playbook, Step
from trainmedic.service.rules.targets import Resolution
from trainmedic.client.wire import keys
from trainmedic.client.wire.protocol import rfc3339
from tests.conftest import post_json, write_playbooks

JOB_PLAYBOOKS = """\
playbooks:
  - name: halve-lr
    matchers: ['alertname="TrainingLossSpike"']
    target: job
    actions:
      - scale_lr: {factor: 0.5, min_lr: 1.0e-7}
  - name: quarter-lr
    matchers: ['alertname="Quarter"']
    target: job
    actions:
      - scale_lr: {factor: 0.25}
  - name: save
    matchers: ['alertname="Save"']
    target: job
    actions:
      - save_checkpoint: {}
  - name: stop
    matchers: ['alertname="Stop"']
    target: job
    actions:
      - stop_training: {}
  - name: rollback-then-halve
    matchers: ['alertname="Rollback"']
    target: job
    actions:
      - rollback_checkpoint: {}
      - scale_lr: {factor: 0.5}
  - name: free-memory
    matchers: ['alertname="Memory"']
    target: job
    actions:
      - empty_cache: {}
      - reduce_batch_size: {factor: 0.5, min: 1}
  - name: short-lived
    matchers: ['alertname="ShortLived"']
    target: job
    expire_after: 1s
    actions:
      - scale_lr: {factor: 0.5}
"""


def job_app(make_app: Any, tmp_path: Path) -> Any:
    """The service with the job playbooks above, on the test Redis."""
    path = write_playbooks(tmp_path / "jobs.yaml", JOB_PLAYBOOKS)
    return make_app(PLAYBOOKS=str(path))


def trigger(http: Any, playbook: str, job: str) -> dict:
    """POST /remediations for a job; returns the record the service answered with."""
    resp = post_json(http, "/remediations", {"playbook": playbook, "labels": {"job_name": job}})
    assert resp.status_code == 201, resp.get_json()
    rec = resp.get_json()
    assert rec["status"] == "dispatched", rec
    return rec


def send(r: redis.Redis, job: str, action: str, params: dict | None = None, expire_after: float = 3600.0) -> str:
    """Dispatch one action to a job as `trainmedic send` does (no playbook validation); returns the record id."""
    pb = Playbook(name="manual", matchers=(), target="job", actions=(Step(action, params or {}),),
                  expire_after=expire_after)
    alert = parse_alert({"status": "firing", "startsAt": rfc3339(),
                         "labels": {"alertname": "manual", "job_name": job}}, "send")
    d = dispatch.Decision(pb, "manual", alert, Resolution(keys.Target("job", job), {}))
    out = dispatch.Dispatcher(r, dispatch.Settings()).execute([d])[0]
    assert out.status == "dispatched" and out.record_id
    return out.record_id


def settled(rec: dict | None) -> bool:
    return rec is not None and all(a["status"] not in ("pending", "delivered") for a in rec["actions"])


def wait_record(r: redis.Redis, rid: str, until: Callable[[dict | None], bool] = settled,
                timeout: float = 15.0, tick: Callable[[], Any] | None = None) -> dict:
    """Read the record until `until` holds (calling tick() between reads, e.g. a training step)."""
    deadline = time.monotonic() + timeout
    rec = history.get(r, rid)
    while not until(rec):
        if time.monotonic() > deadline:
            raise AssertionError(f"record {rid} did not get there in {timeout}s: {rec}")
        if tick is not None:
            tick()
        else:
            time.sleep(0.02)
        rec = history.get(r, rid)
    assert rec is not None
    return rec


def wait_until(cond: Callable[[], Any], timeout: float = 10.0, tick: Callable[[], Any] | None = None,
               what: str = "condition") -> Any:
    """Call cond() until it is truthy (tick() or a short sleep in between); AssertionError at timeout."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout}s")
        if tick is not None:
            tick()
        else:
            time.sleep(0.02)


def mailbox_entries(r: redis.Redis, job: str) -> list:
    return r.xrange(keys.mailbox(keys.Target("job", job)))
