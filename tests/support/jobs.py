"""Helpers for tests: job playbooks, sending through the service, injecting commands, waiting for acks."""
from __future__ import annotations

import json

import time
from pathlib import Path
from typing import Any
from collections.abc import Callable, Sequence

import redis

from trainmedic.service.store import record as records
from trainmedic.client.wire import keys
from trainmedic.client.wire.protocol import Command, command_message, command_of_record
from trainmedic.service.store.decision import Step
from trainmedic.service.app import create_app
from trainmedic.service.decide import plan
from trainmedic.service.rules.playbooks import Playbook
from trainmedic.service.rules.targets import Resolution
from tests.conftest import OPERATOR, ROOT, SIGNING_KEY, TOKEN, post_json, write_playbooks

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
    return make_app(playbooks=str(path))


def trigger(http: Any, playbook: str, job: str) -> dict:
    """POST /remediations for a job; returns the record the service answered with."""
    resp = post_json(http, "/remediations", {"playbook": playbook, "labels": {"job_name": job}})
    assert resp.status_code == 201, resp.get_json()
    rec = resp.get_json()
    # A fast applier may have acknowledged before the service read the record back to answer.
    assert rec["status"] in {"dispatched", "applied", "partially_applied", "failed"}, rec
    return rec


_apps: dict[str, Any] = {}


def service(r: redis.Redis) -> Any:
    """The service (a Flask app) on the Redis that r talks to, made once per Redis."""
    kw = r.connection_pool.connection_kwargs
    url = f"redis://{kw.get('host', '127.0.0.1')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"
    if url not in _apps:
        _apps[url] = create_app({"TESTING": True, "redis_url": url, "webhook_token": TOKEN, "operator_token": OPERATOR,
                                 "signing_key": SIGNING_KEY, "playbooks": str(ROOT / "playbooks")})
        # It hears what trainers and agents say, as every gunicorn worker does (for the session's length).
        _apps[url].extensions["trainmedic"].reconciler.listener.start()
    return _apps[url]


def send(r: redis.Redis, job: str, action: str, params: dict | None = None, expire_after: float = 3600.0,
         kind: str = "job") -> str:
    """One command through POST /commands, as `trainmedic send` does; returns the record id."""
    resp = post_json(service(r).test_client(), "/commands",
                     {"target": f"{kind}:{job}", "action": action, "params": params or {},
                      "expire_after": f"{int(expire_after * 1000)}ms"})
    assert resp.status_code == 201, resp.get_json()
    return str(resp.get_json()["id"])


def inject(r: redis.Redis, target: keys.Target, steps: Sequence[tuple[str, dict]], context: dict | None = None,
           expire_after: float = 3600.0) -> str:
    """A signed command the API would refuse (unknown action, bad params), through the service's dispatcher."""
    pb = Playbook(name="manual", matchers=(), target=target.kind, actions=tuple(Step(a, p) for a, p in steps),
                  expire_after=expire_after)
    label = "job_name" if target.kind == "job" else "node"
    d = plan.manual(pb, {label: target.name}, None, "operator")
    d = plan.Decision(d.playbook, d.mode, d.alert, Resolution(target, context or {}), d.requested_by)
    disp = service(r).extensions["trainmedic"].dispatcher
    # No look at the target's heartbeat: every step goes out, since the applier must answer for anything.
    made = disp.new_record(d, time.time())
    [o] = disp.submit([made])
    assert o.status == "dispatched", o.status
    return str(o.record_id)


def wait_capable(r: redis.Redis, job: str, action: str, tick: Callable[[], Any] | None = None) -> None:
    """Wait until the job's heartbeat lists the action (a handler registered just now): the service decides a
    command from what the heartbeat says the job can apply."""
    def listed() -> bool:
        raw = r.get(keys.heartbeat(keys.Target("job", job)))
        return bool(raw) and action in (json.loads(raw).get("actions") or [])
    wait_until(listed, tick=tick, what=f"{job}'s heartbeat to list {action}")


def settled(rec: dict | None) -> bool:
    return rec is not None and all(a["status"] not in ("pending", "delivered") for a in rec["actions"])


def wait_record(r: redis.Redis, rid: str, until: Callable[[dict | None], bool] = settled,
                timeout: float = 15.0, tick: Callable[[], Any] | None = None) -> dict:
    """Read the record until `until` holds (calling tick() between reads, e.g. a training step)."""
    deadline = time.monotonic() + timeout
    rec = records.get(r, rid)
    while not until(rec):
        if time.monotonic() > deadline:
            raise AssertionError(f"record {rid} did not get there in {timeout}s: {rec}")
        if tick is not None:
            tick()
        else:
            time.sleep(0.02)
        rec = records.get(r, rid)
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


def entry_command(r: redis.Redis, target: keys.Target, fields: dict) -> tuple[Command, bytes, str]:
    """A mailbox entry's command, the bytes it is signed over and its signature, rebuilt from the record it names
    (`r`) as an applier rebuilds it (client/receiver/mailbox.py)."""
    rid = fields["r"] + f"~{target.kind}~{target.name}" if len(fields["r"]) == 26 else fields["r"]
    d, sig, exp, send, legacy = r.hmget(keys.record(rid), "d", "sig", "exp", "send", "cmd")
    if legacy is not None:
        return Command.from_json(legacy), legacy.encode(), sig or ""
    assert d is not None and sig is not None, f"record {rid} holds no command"
    return (command_of_record(rid, d, int(exp), send or ""), command_message(rid, int(exp), send or "", d), sig)


def episode(r: redis.Redis, target: keys.Target, playbook: str, fingerprint: str) -> dict[str, str]:
    """An alert's episode, from the target's state: its fields without their playbook and fingerprint."""
    head = keys.episode_fields(playbook, fingerprint, "")[0]
    return {k[len(head):]: v for k, v in r.hgetall(keys.target_state(target)).items() if k.startswith(head)}
