"""checkpoint_jobs (README: Node agent): before a node record's later actions go out, every job with a live
process on the node saves a checkpoint, each in a record of its own linked to the node's record.

The reconciler runs this for a node record whose pending steps begin with checkpoint_jobs (DECIDE deferred its
command, as it does for `when:` conditions). State lives in Redis only, so a reconciler that restarts, or a
replica that races it, carries on where the other stopped:
- the first pass chooses the jobs and their record ids and keeps them on the node record (HSETNX `ckpt`: one
  plan wins), then decides each job's record under exactly that id, once (an existing record is left alone);
- later passes read the jobs' records: the wait ends when each one settled (acknowledged, or decided early
  because the job cannot save a checkpoint), its job stopped heartbeating, or `timeout` passed;
- then the step is ended with its result and the node's later steps are sent (Conditions, lua/deferred.lua).
A job with ranks on several nodes has one heartbeat naming all of them (`nodes`), so it checkpoints once.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from ...client.wire import keys
from ...client.wire.actions import CATALOGUE
from ...client.wire.status import ActionStatus, RecordStatus

from ..rules.alerts import alert_of_record
from ..rules.playbooks import Playbook
from ..rules.targets import Resolution
from ..store import record
from ..store.decision import Step
from ..store.record import StoredRecord
from .dispatch import Dispatcher, new_record_id
from .plan import Decision

log = logging.getLogger("trainmedic.checkpoints")

ACTION = "checkpoint_jobs"
# While it waits, the node record is looked at this often (a job's ack does not wake the node's target).
POLL = 1.0
# Heartbeats read per round trip while looking for the node's jobs.
SCAN_BATCH = 500
# Statuses of a job's record that end the wait for it.
WAITING = (RecordStatus.DISPATCHED, RecordStatus.PENDING_APPROVAL)


@dataclass(frozen=True)
class Step0:
    """The checkpoint_jobs step of a node record: its index and how long it waits."""

    index: int
    timeout: float


def pending_step(rec: StoredRecord) -> Step0 | None:
    """The record's checkpoint_jobs step when it is still pending, else None."""
    for i, a in enumerate(rec.actions):
        if a.step.action == ACTION and a.status == ActionStatus.PENDING:
            return Step0(i, CATALOGUE[ACTION].parse(a.step.params).timeout)
    return None


def on_node(heartbeat: str | None, node: str) -> bool:
    """Whether a job's heartbeat says it has a process on the node (its own node, or any rank's)."""
    try:
        info = json.loads(heartbeat) if heartbeat else None
    except ValueError:
        return False
    if not isinstance(info, dict):
        return False
    nodes = info.get("nodes")
    named = [n for n in nodes if isinstance(n, str)] if isinstance(nodes, list) else []
    return node == info.get("node") or node in named


class Checkpoints:
    """The checkpoint phase of node records; see the module's docstring."""

    def __init__(self, r: Any, dispatcher: Dispatcher):
        self.r = r
        self.dispatcher = dispatcher

    def jobs_on(self, node: str, now: float) -> list[str]:
        """Names of the live jobs with a process on the node, sorted."""
        labels = self.r.zrangebyscore(keys.live("job"), f"({int(now * 1000)}", "+inf")
        found: list[str] = []
        for start in range(0, len(labels), SCAN_BATCH):
            batch = [t for t in (keys.parse_label(x) for x in labels[start:start + SCAN_BATCH]) if t is not None]
            pipe = self.r.pipeline(transaction=False)
            for t in batch:
                pipe.get(keys.heartbeat(t))
            found.extend(t.name for t, raw in zip(batch, pipe.execute()) if on_node(raw, node))
        return sorted(found)

    def plan(self, rec: StoredRecord, step: Step0, now: float) -> dict[str, Any]:
        """The node record's checkpoint plan: made by the first pass, read back by every later one."""
        rid = rec.id
        if rec.checkpoint_plan:
            return dict(json.loads(rec.checkpoint_plan))
        node = rec.target.name
        jobs = self.jobs_on(node, now)
        plan = {"started_ms": int(now * 1000), "deadline_ms": int((now + step.timeout) * 1000),
                "jobs": [[job, new_record_id(keys.Target("job", job))] for job in jobs]}
        if not record.mark_once(self.r, rid, "ckpt", json.dumps(plan, separators=(",", ":"))):
            return dict(json.loads(record.field_of(self.r, rid, "ckpt") or "{}"))
        return plan

    def start(self, rec: StoredRecord, plan: dict[str, Any], pb: Playbook | None, now: float) -> None:
        """Decide each job's save_checkpoint record that does not exist yet (under its planned id)."""
        jobs = [(str(job), str(cid)) for job, cid in plan.get("jobs") or []]
        if not jobs:
            return
        pipe = self.r.pipeline(transaction=False)
        for _, cid in jobs:
            pipe.exists(keys.record(cid))
        missing = [(job, cid) for (job, cid), there in zip(jobs, pipe.execute()) if not there]
        if not missing:
            return
        alert = alert_of_record(rec.alert_dict, "firing", rec.fingerprint)
        left = max(1.0, int(plan["deadline_ms"]) / 1000 - now)
        child = Playbook(name=rec.playbook or (pb.name if pb else "manual"), matchers=(), target="job",
                         actions=(Step("save_checkpoint", {}),), expire_after=left)
        for job, cid in missing:
            d = Decision(child, "manual", alert, Resolution(keys.Target("job", job), {}),
                         requested_by=rec.requested_by)
            o = self.dispatcher.decide_one(d, now, parent=rec.id, rid=cid)
            log.info("checkpoint of job %s for %s: %s", job, rec.id, o.status,
                     extra={"remediation_id": cid, "target": f"job:{job}"})

    def wait(self, rec: StoredRecord, step: Step0, pb: Playbook | None,
             now: float) -> tuple[str, str, str] | None:
        """(status, reason, result JSON) of the checkpoint step once its wait is over, else None (still waiting)."""
        plan = self.plan(rec, step, now)
        self.start(rec, plan, pb, now)
        jobs = [(str(job), str(cid)) for job, cid in plan.get("jobs") or []]
        started = int(plan["started_ms"]) / 1000
        if not jobs:
            result = {"jobs": [], "waited": "no_jobs", "waited_s": 0.0,
                      "message": f"No job has a live process on {rec.target.name}."}
            return "skipped", "no_jobs", json.dumps(result)
        pipe = self.r.pipeline(transaction=False)
        for job, cid in jobs:
            pipe.hget(keys.record(cid), "status")
            pipe.exists(keys.heartbeat(keys.Target("job", job)))
        got = pipe.execute()
        rows = []
        for k, (job, cid) in enumerate(jobs):
            status, live = got[2 * k], bool(got[2 * k + 1])
            rows.append({"job": job, "id": cid, "status": status or "missing",
                         "gone": status in WAITING and not live})
        timed_out = now * 1000 >= int(plan["deadline_ms"])
        if not timed_out and any(row["status"] in WAITING and not row["gone"] for row in rows):
            return None
        waited = "timeout" if any(row["status"] in WAITING and not row["gone"] for row in rows) else "acknowledged"
        if any(row["gone"] for row in rows) and waited == "acknowledged":
            waited = "acknowledged_or_gone"
        saved = [row for row in rows if row["status"] == RecordStatus.APPLIED]
        for row in rows:
            if not row["gone"]:
                del row["gone"]
        message = {
            "acknowledged": f"Every job on the node acknowledged its checkpoint ({len(saved)} of {len(rows)} saved).",
            "acknowledged_or_gone": f"Every job on the node acknowledged its checkpoint or stopped heartbeating "
                                    f"({len(saved)} of {len(rows)} saved).",
            "timeout": f"The timeout passed before every job acknowledged its checkpoint ({len(saved)} of "
                       f"{len(rows)} saved); the node's next actions went ahead.",
        }[waited]
        result = {"jobs": rows, "waited": waited, "waited_s": round(max(0.0, now - started), 3), "message": message}
        if saved:
            return "applied", "", json.dumps(result)
        return "failed", "timeout" if waited == "timeout" else "not_saved", json.dumps(result)

    def retry_at(self, target: keys.Target, rid: str, now: float) -> None:
        """Look at the node record again soon: its jobs' acks do not wake the node's target."""
        at = int((now + POLL) * 1000)
        pipe = self.r.pipeline(transaction=False)
        pipe.zadd(keys.due_items(target), {rid: at})
        pipe.zadd(keys.DUE, {target.label: at}, lt=True)
        pipe.execute()

