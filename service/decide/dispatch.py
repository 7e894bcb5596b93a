"""Guard, record, sign and dispatch: one DECIDE script per (alert, playbook) on the target's hash slot."""
from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from dataclasses import dataclass, replace
from typing import Any
from collections.abc import Iterable, Sequence

from ...client.wire import keys
from ...client.wire.actions import BY_SERVICE
from ...client.wire.protocol import command_message, parse_rfc3339
from ...client.wire.signing import Signer
from ...client.wire.status import ActionReason, ActionStatus, Mode, Reason, RecordStatus

from .. import lemons
from ..store import decision, record
from ..store.decision import Early, NewRecord, Step, send_arg
from ..store.scripts import Decided, Keyspace, approve_call, decide_many_calls
from ..store.seals import seal_text
from .breaker import HOLDS, Breaker
from .plan import Decision

log = logging.getLogger("trainmedic.dispatch")

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
# Two Crockford characters per 10 bits: an id is 13 look-ups instead of 26.
_PAIRS = [a + b for a in _CROCKFORD for b in _CROCKFORD]
# Per thread: the last id's microseconds (ids of one thread strictly increase, so a notification's records list
# in order) and a generator seeded once from os.urandom, so an id costs no system call. A notification is
# decided by one thread, and a lock shared by a worker's threads showed in the storm's profile.
_local = threading.local()


def new_record_id(target: keys.Target) -> str:
    """A time-sortable id (microseconds, then randomness) that also names its target, so its keys can be found."""
    gen = getattr(_local, "gen", None)
    if gen is None or getattr(_local, "pid", None) != os.getpid():  # a forked worker seeds its own
        gen = _local.gen = random.Random(os.urandom(32))
        _local.pid = os.getpid()
    us = max(time.time_ns() // 1000, getattr(_local, "us", 0) + 1)
    _local.us = us
    n = (us << 75) | gen.getrandbits(75)
    ulid = "".join([_PAIRS[(n >> s) & 1023] for s in range(120, -10, -10)])
    return f"{ulid}~{target.kind}~{target.name}"


@dataclass(frozen=True)
class DispatchSettings:
    """Service-wide knobs for deciding and recording."""

    dry_run: bool = False
    # Refreshed by every resend, so a long episode stays one episode; a closed one is kept this long too
    # (tombstones: a firing retry that arrives after its resolve is still a duplicate).
    episode_ttl: float = 2 * 86400.0
    mailbox_max: int = decision.MAILBOX_MAX
    # With Alertmanager's API, the reconciler asks it about open obligations this often; without it, it
    # waits each playbook's resolve_timeout after the last firing notification.
    alertmanager_poll: float | None = None
    # TRAINMEDIC_NOTIFY_URL is set: every playbook notifies, so every record is followed.
    notify: bool = False


@dataclass(frozen=True)
class Outcome:
    """What became of one decision."""

    status: str
    record_id: str | None
    playbook: str
    fingerprint: str
    reason: str | None = None

    @property
    def new(self) -> bool:
        """A record was made (not a resend of a handled episode, not a resolve with nothing to undo)."""
        return bool(self.record_id) and self.status not in ("duplicate", "stale", "closed")

    def as_dict(self) -> dict:
        return {"id": self.record_id, "playbook": self.playbook, "fingerprint": self.fingerprint,
                "status": self.status, "reason": self.reason}


@dataclass(frozen=True)
class Draft:
    """A decision's record before its command is signed (Dispatcher._draft), so that a notification's commands
    can share one signature."""

    decision: Decision
    now: float
    rid: str
    decided: str  # the record's `d`
    early: Early
    send: tuple[tuple[int, Step], ...]
    defer: bool
    message: bytes  # what the command is signed over (b"" when nothing goes out now)
    reach: Reach | None
    check_reach: bool
    prev: str
    parent: str
    extra: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Reach:
    """What a target's heartbeat says: whether a process is live, and the actions it can apply."""

    live: bool
    actions: frozenset[str] | None = None  # None: it does not say (an older client)

    @classmethod
    def from_heartbeat(cls, raw: str | None) -> Reach:
        if not raw:
            return cls(False)
        try:
            listed = json.loads(raw).get("actions")
        except (ValueError, AttributeError):
            return cls(True)
        ok = isinstance(listed, list) and all(isinstance(a, str) for a in listed)
        return cls(True, frozenset(listed) if ok else None)


def plan_send(target: keys.Target, steps: Sequence[Step],
              reach: Reach | None) -> tuple[Early, list[tuple[int, Step]], bool]:
    """Which steps go out now: (decided early, (index, step) to send, whether `when:` conditions come first).

    A live target whose heartbeat does not list a step's action cannot apply it: an optional step is
    skipped (`unsupported`), another is `unsupported` / `target_cannot` at once; the rest still go out.
    A step the service carries out itself (checkpoint_jobs) defers the whole command to the reconciler too.
    """
    early: list[tuple[int, str, str, str]] = []
    send: list[tuple[int, Step]] = []
    for i, st in enumerate(steps):
        if st.action in BY_SERVICE:
            send.append((i, st))
        elif reach is not None and reach.live and reach.actions is not None and st.action not in reach.actions:
            why = (f"The live process of {target.label} cannot apply {st.action}: its heartbeat does not list it"
                   f"{' (register a handler for it)' if target.kind == 'job' else ''}.")
            early.append((i, ActionStatus.SKIPPED, ActionReason.UNSUPPORTED, why) if st.optional else
                         (i, ActionStatus.UNSUPPORTED, ActionReason.TARGET_CANNOT, why))
        else:
            send.append((i, st))
    return tuple(early), send, any(st.when or st.action in BY_SERVICE for _, st in send)


def _ms_of(text: str, default: float) -> int:
    """Milliseconds since the epoch of an RFC 3339 time (a resolve's endsAt), else of `default`."""
    t = parse_rfc3339(text)
    return int((default if t is None else t) * 1000)


class Dispatcher:
    """Runs decisions against Redis: one round trip for the scripts of a whole notification, one for indexes."""

    def __init__(self, r: Any, signer: Signer, settings: DispatchSettings):
        self.r = r
        self.signer = signer
        self.settings = settings
        self.keyspace = Keyspace(r)
        self.breaker = Breaker(r)

    def execute(self, decisions: list[Decision], now: float | None = None) -> list[Outcome]:
        """Decide, record and dispatch each decision atomically, and index the new records (now: the decision's
        time, for a virtual clock; else the clock's).

        One DECIDE_MANY call per hash slot, all in one pipeline: on a single Redis that is one call for the
        whole notification, indexes included (one round trip, two with a bounded playbook's breaker); on Redis
        Cluster one call per slot that the notification's targets fall in, then the indexes (their own slots) in
        a second pipeline.
        """
        if not decisions:
            return []
        now = time.time() if now is None else now
        # The breaker first (its own slot): a pair refused a place is recorded skipped / breaker_open.
        bounded = [i for i, d in enumerate(decisions) if d.playbook.max_active and d.mode == "firing"
                   and d.steps and not d.resolution.reason and d.target.name]
        rids = {i: new_record_id(decisions[i].target) for i in bounded}
        claims = dict(zip(bounded, self.breaker.claim([(decisions[i].playbook, rids[i]) for i in bounded], now)))
        for i, claim in claims.items():
            if claim != "ok":
                d = decisions[i]
                decisions[i] = replace(d, resolution=replace(d.resolution, reason=Reason.BREAKER_OPEN, detail=(
                    f"Playbook {d.playbook.name} has as many targets with an open remediation as its max_active "
                    "allows, so this one was not dispatched.")))
        # DECIDE reads each target's heartbeat itself; a pair whose command does not fit it comes back
        # 'reach' (nothing written) and is decided again below with the heartbeat read here.
        # One Ed25519 signature for the notification's commands (Signer.sign_many): each still verifies alone.
        news = self.new_records([self._draft(d, now, rid=rids.get(i, ""), check_reach=bool(
            d.steps and not d.resolution.reason and d.target.name)) for i, d in enumerate(decisions)])
        answers = self._run(news)
        again = [i for i, a in enumerate(answers) if a.status == "reach"]
        if again:
            reach = self.reach({decisions[i].target for i in again})
            redone = self.new_records([self._draft(decisions[i], now, reach=reach.get(decisions[i].target),
                                                   rid=news[i].rid) for i in again])
            for i, n in zip(again, redone):
                news[i] = n
            for i, a in zip(again, self._run([news[i] for i in again])):
                answers[i] = a
        if claims:
            self.breaker.release([(decisions[i].playbook, rids[i]) for i, c in claims.items()
                                  if c == "ok" and answers[i].status not in HOLDS], now)
            for i, c in claims.items():
                if c == "opened" and answers[i].status == RecordStatus.SKIPPED:
                    self.breaker.opened(rids[i], decisions[i].playbook.name, now)
        return self._finish(news, answers)

    def submit(self, news: list[NewRecord]) -> list[Outcome]:
        """Decide records made by new_record as they are (no second look at the heartbeat), and index them."""
        return self._finish(news, self._run(news))

    def _finish(self, news: list[NewRecord], answers: list[Decided]) -> list[Outcome]:
        """The outcomes of DECIDE_MANY's answers; on Redis Cluster, the indexes it could not write itself.

        The scripts journaled the records: a history query folds the journal in before it answers, so they are
        listed as soon as the webhook has answered, without the webhook waiting for the indexer.
        """
        outcomes = [Outcome(status=a.status, record_id=a.record_id, playbook=n.playbook, fingerprint=n.fingerprint,
                            reason=a.reason) for n, a in zip(news, answers)]
        if not self.keyspace.single:
            self._index_elsewhere(outcomes, news, answers)
        return outcomes

    def _run(self, news: list[NewRecord]) -> list[Decided]:
        """DECIDE_MANY's answers for these pairs, in order: one pipeline of calls, a group per hash slot (one
        group on a single Redis, where the calls write the indexes too)."""
        from ...client.wire.cluster import by_slot

        ks = self.keyspace
        groups = by_slot(self.r, news, lambda n: n.target.tag)
        calls = [c for idxs in groups for c in decide_many_calls(ks, [news[i] for i in idxs], ks.single)]
        flat = [a for batch in ks.run(calls, (n.target for n in news)) for a in batch]
        answers: list[Decided] = [Decided("", None, None, None)] * len(news)
        for i, a in zip((i for idxs in groups for i in idxs), flat):
            answers[i] = Decided.of(a)
        return answers

    def reach(self, targets: Iterable[keys.Target]) -> dict[keys.Target, Reach]:
        """Each target's heartbeat, read in one round trip."""
        ts = [t for t in set(targets) if t.name]
        if not ts:
            return {}
        pipe = self.r.pipeline(transaction=False)
        for t in ts:
            pipe.get(keys.heartbeat(t))
        return {t: Reach.from_heartbeat(raw) for t, raw in zip(ts, pipe.execute())}

    def new_record(self, d: Decision, now: float, prev: str = "", parent: str = "",
                   extra: tuple[tuple[str, str], ...] = (), reach: Reach | None = None,
                   check_reach: bool = False, rid: str = "") -> NewRecord:
        """The DECIDE arguments for one decision, its command signed (prev, parent: a stage's ladder, or the
        node record a checkpoint belongs to); check_reach: made with every step, for DECIDE to check against
        the heartbeat; rid: the record's id when the caller chose it already."""
        return self.new_records([self._draft(d, now, prev, parent, extra, reach, check_reach, rid)])[0]

    def new_records(self, drafts: list[Draft]) -> list[NewRecord]:
        """The records of several drafts, their commands signed with one signature (Signer.sign_many; a
        lone command gets a plain one)."""
        sigs = iter(self.signer.sign_many([x.message for x in drafts if x.message]))
        return [self._record(x, next(sigs) if x.message else "") for x in drafts]

    def _draft(self, d: Decision, now: float, prev: str = "", parent: str = "",
               extra: tuple[tuple[str, str], ...] = (), reach: Reach | None = None,
               check_reach: bool = False, rid: str = "") -> Draft:
        """A decision's record before its command is signed: its id, what was decided, what goes out now."""
        pb, target = d.playbook, d.target
        rid = rid or new_record_id(target)
        steps = d.steps
        decided = decision.decided_text(pb.name, d.mode, d.requested_by, d.alert.as_dict(), steps,
                                        d.resolution.context, d.alert.episode_start, d.stage, parent,
                                        pb.expire_after)
        early, send, defer = plan_send(target, steps, reach)
        message = b""
        if send and not defer and not d.resolution.reason:
            message = command_message(rid, int((now + pb.expire_after) * 1000),
                                      send_arg([i for i, _ in send], len(steps)), decided)
        return Draft(d, now, rid, decided, early, tuple(send), defer, message, reach, check_reach, prev, parent,
                     extra)

    def _record(self, x: Draft, signature: str) -> NewRecord:
        """A draft's DECIDE arguments, with its command's signature."""
        d, now, s = x.decision, x.now, self.settings
        pb = d.playbook
        return NewRecord(
            rid=x.rid, target=d.target, playbook=pb.name, mode=d.mode, decided=x.decided, n=len(d.steps),
            alertname=d.alert.alertname, episode_start=d.alert.episode_start, fingerprint=d.alert.fingerprint,
            now=now, detail=d.resolution.detail or "", forced_reason=d.resolution.reason or "",
            ends_at=d.alert.ends_at if d.mode == "resolved" else "",
            ends_ms=_ms_of(d.alert.ends_at, now) if d.mode == "resolved" else 0, extra=x.extra,
            expires_at=now + pb.expire_after,
            guards=decision.Guards(cooldown=pb.cooldown, budget=pb.max_runs or (0, 0.0), approval=pb.approval,
                                   approval_timeout=pb.approval_timeout, dry_run=pb.dry_run or s.dry_run),
            keep=decision.Retention(expire_after=pb.expire_after, episode_ttl=s.episode_ttl,
                                    obligation_due=s.alertmanager_poll or pb.resolve_timeout,
                                    mailbox_max=s.mailbox_max),
            ladder=decision.Ladder(stage=d.stage, parent=x.parent, prev=x.prev),
            delivery=decision.Delivery(
                signature=signature, send=send_arg([i for i, _ in x.send], len(d.steps)), early=x.early,
                no_live=x.reach is not None and not x.reach.live, defer=x.defer, check_reach=x.check_reach,
                need=tuple(st.action for _, st in x.send if st.action not in BY_SERVICE) if x.check_reach else (),
                follow=d.answers_for_alert or bool(pb.notify) or s.notify or x.defer,
                visit_now=x.defer or bool(pb.notify) or s.notify or pb.silence, undo=bool(pb.on_resolved),
                verify=pb.verify if d.answers_for_alert else None),
            seal=self.signer.seal(seal_text(x.rid, x.decided)),
            incident=lemons.counts_as_incident(d.target.kind, d.mode, pb.name))

    def _index_elsewhere(self, outcomes: list[Outcome], news: list[NewRecord], answers: list[Decided]) -> None:
        """Redis Cluster: the approvals and due-target indexes (their own slots) of what DECIDE_MANY decided,
        at the due times it answered, and the nodes it counted an incident of (lua/decide_many.lua writes them
        itself on a single Redis)."""
        due: dict[str, int] = {}
        for n, a in zip(news, answers):
            if a.first_ms is not None:
                due[n.target.label] = min(due.get(n.target.label, a.first_ms), a.first_ms)
        held = {o.record_id: int((n.now + n.guards.approval_timeout) * 1000) for o, n in zip(outcomes, news)
                if o.status == RecordStatus.PENDING_APPROVAL}
        struck = [n for n, a in zip(news, answers) if a.incident]
        if not (due or held or struck):
            return
        pipe = self.r.pipeline(transaction=False)
        for n in struck:
            lemons.seen(pipe, [n.target.name], n.now)
        if held:
            pipe.zadd(keys.APPROVALS, held)
        if due:
            # Each target's earliest due time; LT never moves one later (the reconciler does that itself).
            pipe.zadd(keys.DUE, due, lt=True)
        pipe.execute()

    def decide_one(self, d: Decision, now: float | None = None, prev: str = "", parent: str = "",
                   extra: tuple[tuple[str, str], ...] = (), rid: str = "") -> Outcome:
        """One decision on its own (manual triggers, the reconciler's on_resolved, stages and checkpoints)."""
        reach = self.reach([d.target]).get(d.target) if d.steps and not d.resolution.reason else None
        return self.submit([self.new_record(d, time.time() if now is None else now, prev, parent, extra, reach,
                                            rid=rid)])[0]

    def refuse_tampered(self, record_id: str, what: str) -> None:
        """Count and log a record whose hash no longer matches its seal, where the service refused to act on it."""
        self.r.incr(keys.TAMPERED)
        log.error("remediation %s was changed in Redis after it was decided; %s was refused", record_id, what,
                  extra={"remediation_id": record_id})

    def decide_held(self, record_id: str, verb: str, by: str, comment: str, undo: bool,
                    obligation_due: float, now: float | None = None) -> list[str]:
        """Approve (release, signed anew with a fresh expiry) or reject a record held for approval.

        The release signs only what was decided. A hold is pending only while the service's approvals index
        (which no trainer or agent may write) lists it, with its deadline: a record that says it is held while
        the index does not list it, or whose decision no longer matches its seal (someone wrote to it in Redis),
        is never signed: it ends `skipped` / `tampered` instead (verb 'tamper' of APPROVE)."""
        now = time.time() if now is None else now
        try:
            rec = record.load(self.r, record_id)
        except record.BadRecord:
            rec = None
        if rec is None:
            return ["missing"]
        if rec.status != RecordStatus.PENDING_APPROVAL:
            return ["not_pending", rec.status]
        target = rec.target
        deadline = self.r.zscore(keys.APPROVALS, record_id)
        if deadline is None or not rec.decided or not rec.intact(self.signer):
            verb = "tamper"
        early: Early = ()
        send: list[tuple[int, Step]] = []
        defer = False
        signature = sent = ""
        expires_at = now + rec.expire_after
        if verb == "approve":
            early, send, defer = plan_send(target, rec.steps, self.reach([target]).get(target))
        if send and not defer:
            sent = send_arg([i for i, _ in send], rec.n)
            signature = self.signer.sign(command_message(record_id, int(expires_at * 1000), sent, rec.decided))
        ks = self.keyspace
        answer = [str(x) for x in ks.run([approve_call(
            ks, record_id, verb=verb, now=now, by=by, comment=comment, signature=signature, send=sent,
            expires_at=expires_at, playbook=rec.playbook, fingerprint=rec.fingerprint,
            firing=rec.mode in (Mode.FIRING, Mode.STAGE), undo=undo, obligation_due=obligation_due,
            episode_ttl=self.settings.episode_ttl, deadline_ms=int(deadline if deadline is not None else 0),
            early=early, defer=defer, incident=lemons.counts_as_incident(target.kind, rec.mode, rec.playbook))],
            [target])[0]]
        if answer[0] == Reason.TAMPERED:
            self.refuse_tampered(record_id, "its approval")
        pipe = self.r.pipeline(transaction=False)
        pipe.zrem(keys.APPROVALS, record_id)
        if answer[:2] == [RecordStatus.DISPATCHED, "1"]:  # the node's incident: its series are shown from now on
            lemons.seen(pipe, [target.name], now)
        if answer[0] == RecordStatus.DISPATCHED or rec.follow:
            first = now if rec.follow else min(now + rec.expire_after, now + obligation_due)
            pipe.zadd(keys.DUE, {target.label: int(first * 1000)}, lt=True)
        pipe.execute()
        return answer
