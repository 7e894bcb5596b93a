"""Records whose steps carry `when:` conditions (README: Playbooks, `when:`): the reconciler evaluates each one
against Prometheus (never the webhook), then sends the steps that may run as one signed command. A false
condition skips its step (`condition_false`); no Prometheus, a timeout, an error or a variable without a
value skip it too (`condition_unknown`)."""
from __future__ import annotations

import json
import logging
from typing import Any

from ...client.wire import keys
from ...client.wire.protocol import command_message, dumps, rfc3339
from ...client.wire.status import ActionReason, ActionStatus, Reason

from ..prometheus import Prometheus, PrometheusError
from ..rules import conditions
from ..rules.playbooks import Playbook
from ..store.decision import send_arg
from ..store.record import StoredRecord
from ..store.scripts import deferred_call
from .checkpoints import Checkpoints, pending_step
from .dispatch import Dispatcher

log = logging.getLogger("trainmedic.conditions")

TAMPERED = "Its stored steps no longer match what was decided, so nothing was sent."


class Conditions:
    """Evaluates a deferred record's conditions and sends what may run."""

    def __init__(self, r: Any, dispatcher: Dispatcher, prometheus: Prometheus | None):
        self.r = r
        self.dispatcher = dispatcher
        self.prometheus = prometheus
        self.checkpoints = Checkpoints(r, dispatcher)

    def values(self, target: keys.Target, context: dict[str, Any]) -> dict[str, str | None]:
        """$job, $node and $gpu for a target: a job's node is the host its live heartbeat names."""
        node = target.name if target.kind == "node" else None
        if target.kind == "job":
            raw = self.r.get(keys.heartbeat(target))
            host = json.loads(raw).get("host") if raw else None
            node = host if isinstance(host, str) and keys.TARGET_NAME_RE.match(host) else None
        gpu = context.get("gpu_id") or context.get("gpu_uuid")
        return {"job": target.name if target.kind == "job" else None, "node": node,
                "gpu": str(gpu) if gpu is not None else None}

    def evaluate(self, expr: str, values: dict[str, str | None]) -> tuple[ActionReason | None, str]:
        """(None when the step runs, else its skip reason) and a sentence for the record."""
        if self.prometheus is None:
            return (ActionReason.CONDITION_UNKNOWN,
                    "The condition was not evaluated: TRAINMEDIC_PROMETHEUS_URL is not set.")
        try:
            query = conditions.fill(expr, values)
        except conditions.MissingVariable as exc:
            return (ActionReason.CONDITION_UNKNOWN,
                    f"The condition was not evaluated: ${exc} has no value for this target.")
        try:
            result = self.prometheus.query(query)
        except PrometheusError as exc:
            return ActionReason.CONDITION_UNKNOWN, f"The condition was not evaluated: {exc}."
        if not result:
            return ActionReason.CONDITION_FALSE, f"The condition returned nothing, so the step did not run: {query}"
        return None, f"The condition held: {query}"

    def run(self, target: keys.Target, rec: StoredRecord, now: float, pb: Playbook | None = None) -> str | None:
        """Carry out checkpoint_jobs first, then evaluate the pending steps' conditions and send the rest; the
        record's status after (None while its jobs' checkpoints are awaited, or when another did it)."""
        early: list[tuple[int, str, str, str]] = []
        results: dict[int, str] = {}
        send = []
        rid = rec.id
        ks = self.dispatcher.keyspace
        pending = [i for i, a in enumerate(rec.actions) if a.status == ActionStatus.PENDING]
        expires_at = (rec.expires_ms or 0) / 1000
        if not rec.decided or not rec.intact(self.dispatcher.signer):
            # Its hash no longer holds what was decided: nothing of it is sent.
            self.dispatcher.refuse_tampered(rid, "sending its steps after their conditions")
            early = [(i, ActionStatus.SKIPPED, ActionReason.TAMPERED, TAMPERED) for i in pending]
            answer = ks.run([deferred_call(ks, rid, now, "", "", expires_at, tuple(early), Reason.TAMPERED)],
                            [target])[0]
            return str(answer) if answer else None
        ckpt = pending_step(rec)
        if ckpt is not None:
            done = self.checkpoints.wait(rec, ckpt, pb, now)
            if done is None:
                self.checkpoints.retry_at(target, rid, now)
                return None
            early.append((ckpt.index, done[0], done[1], ""))
            # The service carried the step out itself: its answer, as an applier's would be.
            results[ckpt.index] = dumps({"reason": done[1] or None, "result": json.loads(done[2]),
                                         "at": rfc3339(now), "by": "service"})
        values = self.values(target, rec.context)
        for i, st in enumerate(rec.steps):
            if i not in pending or i in results:
                continue
            if st.when:
                reason, why = self.evaluate(st.when, values)
                if reason is not None:
                    early.append((i, ActionStatus.SKIPPED, reason, why))
                    continue
            send.append(i)
        signature = sent = ""
        if send:
            # The command goes out now, with what is left of its time (at least a second).
            expires_at = max(expires_at, now + 1.0)
            sent = send_arg(send, rec.n)
            signature = self.dispatcher.signer.sign(command_message(rid, int(expires_at * 1000), sent, rec.decided))
        answer = ks.run([deferred_call(ks, rid, now, signature, sent, expires_at, tuple(early), results=results)],
                        [target])[0]
        log.info("conditions of %s evaluated: %d step(s) sent, %d skipped", rid, len(send), len(early),
                 extra={"remediation_id": rid, "target": target.label})
        return str(answer) if answer else None
