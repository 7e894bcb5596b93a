"""Guard, record, sign and dispatch: one DECIDE script per (alert, playbook) on the target's hash slot."""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, replace
from typing import Any
from collections.abc import Iterable, Sequence

from ...client.wire import cluster, keys, protocol, records
from ...client.wire.actions import BY_SERVICE
from ...client.wire.protocol import ActionCall, Command, parse_rfc3339
from ...client.wire.records import ActionReason, ActionStatus, Mode, Reason, RecordStatus, Step
from ...client.wire.redis import run_scripts
from ...client.wire.signing import Signer

from .breaker import HOLDS, Breaker
from .plan import Decision

log = logging.getLogger("trainmedic.dispatch")

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
# Two Crockford characters per 10 bits: an id is 13 look-ups instead of 26.
_PAIRS = [a + b for a in _CROCKFORD for b in _CROCKFORD]
# The last id's microseconds, per thread: a notification is decided by one thread, and a lock shared by a
# worker's threads showed in the storm's profile (5 % of its samples).
_last = threading.local()


def new_record_id(target: keys.Target) -> str:
    """A time-sortable id (microseconds, then randomness) that also names its target, so its keys can be found."""
    # Strictly increasing within a thread, so records of one notification list in order.
    us = max(time.time_ns() // 1000, getattr(_last, "us", 0) + 1)
    _last.us = us
    n = (us << 75) | int.from_bytes(os.urandom(10), "big") >> 5
    ulid = "".join([_PAIRS[(n >> s) & 1023] for s in range(120, -10, -10)])
    return f"{ulid}~{target.kind}~{target.name}"


@dataclass(frozen=True)
class DispatchSettings:
    """Service-wide knobs for deciding and recording."""

    dry_run: bool = False
    # Refreshed by every resend, so a long episode stays one episode; a closed one is kept this long too
    # (tombstones: a firing retry that arrives after its resolve is still a duplicate).
    episode_ttl: float = 2 * 86400.0
    record_ttl: float = 30 * 86400.0
    mailbox_maxlen: int = 100
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
    early: records.Early
    send: tuple[tuple[int, Step], ...]
    defer: bool
    command: str  # the command's exact bytes, as text ("" when nothing goes out now)
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
              reach: Reach | None) -> tuple[records.Early, list[tuple[int, Step]], bool]:
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


def command_for(record_id: str, target: keys.Target, steps: Iterable[tuple[int, Step]], context: dict, now: float,
                expire_after: float, fingerprint: str = "", fence: str = "", starts_at: str = "") -> Command:
    """The mailbox command for a record's actions (each keeps its index in the record)."""
    calls = tuple(ActionCall(i, st.action, dict(st.params), st.optional) for i, st in steps)
    return Command(record_id=record_id, kind=target.kind, target=target.name, actions=calls, issued_at=now,
                   expires_at=now + expire_after, context=context, fingerprint=fingerprint, fence=fence,
                   starts_at=starts_at)


def _ms_of(text: str, default: float) -> int:
    """Milliseconds since the epoch of an RFC 3339 time (a resolve's endsAt), else of `default`."""
    t = parse_rfc3339(text)
    return int((default if t is None else t) * 1000)


def steps_of(h: dict[str, str]) -> list[Step]:
    """A record's steps, from its hash."""
    return [Step(**json.loads(h[f"a:{i}:spec"])) for i in range(int(h.get("n") or 0))]


class Dispatcher:
    """Runs decisions against Redis: one round trip for the scripts of a whole notification, one for indexes."""

    def __init__(self, r: Any, signer: Signer, settings: DispatchSettings):
        self.r = r
        self.signer = signer
        self.settings = settings
        self.scripts = records.Scripts(r)
        self.breaker = Breaker(r, self.scripts)

    def execute(self, decisions: list[Decision]) -> list[Outcome]:
        """Decide, record and dispatch each decision atomically, and index the new records.

        One DECIDE_MANY call per hash slot, all in one pipeline: on a single Redis that is one call for the
        whole notification, indexes included (one round trip); on Redis Cluster one call per slot that the
        notification's targets fall in, then the indexes (their own slots) in a second pipeline.
        """
        if not decisions:
            return []
        now = time.time()
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
        again = [i for i, a in enumerate(answers) if str(a[0]) == "reach"]
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
                                  if c == "ok" and str(answers[i][0]) not in HOLDS], now)
            for i, c in claims.items():
                if c == "opened" and str(answers[i][0]) == RecordStatus.SKIPPED:
                    self.breaker.opened(rids[i], decisions[i].playbook.name, now)
        return self._finish(news, answers)

    def submit(self, news: list[records.NewRecord]) -> list[Outcome]:
        """Decide records made by new_record as they are (no second look at the heartbeat), and index them."""
        return self._finish(news, self._run(news))

    def _finish(self, news: list[records.NewRecord], answers: list[Any]) -> list[Outcome]:
        """The outcomes of DECIDE_MANY's answers; on Redis Cluster, the indexes it could not write itself.

        The scripts journaled the records: a history query folds the journal in before it answers, so they are
        listed as soon as the webhook has answered, without the webhook waiting for the indexer.
        """
        outcomes = [Outcome(status=str(a[0]), record_id=str(a[1]) or None, playbook=n.playbook,
                            fingerprint=n.fingerprint, reason=str(a[2]) or None) for n, a in zip(news, answers)]
        if not cluster.scripts_reach_all(self.r):
            self._index_elsewhere(outcomes, news, [int(a[3]) for a in answers])
        return outcomes

    def _run(self, news: list[records.NewRecord]) -> list[Any]:
        """DECIDE_MANY's answers for these pairs, in order: one pipeline of calls, a group per hash slot (one
        group on a single Redis, where the calls write the indexes too)."""
        groups = cluster.by_slot(self.r, news, lambda n: n.target.tag)
        index = cluster.scripts_reach_all(self.r)
        calls = [c for idxs in groups for c in records.decide_many_calls(self.scripts, [news[i] for i in idxs], index)]
        flat = [a for batch in run_scripts(self.r, calls) for a in batch]
        answers: list[Any] = [None] * len(news)
        for i, a in zip((i for idxs in groups for i in idxs), flat):
            answers[i] = a
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
                   check_reach: bool = False, rid: str = "") -> records.NewRecord:
        """The DECIDE arguments for one decision, its command signed (prev, parent: a stage's ladder, or the
        node record a checkpoint belongs to); check_reach: made with every step, for DECIDE to check against
        the heartbeat; rid: the record's id when the caller chose it already."""
        return self.new_records([self._draft(d, now, prev, parent, extra, reach, check_reach, rid)])[0]

    def new_records(self, drafts: list[Draft]) -> list[records.NewRecord]:
        """The records of several drafts, their commands signed with one signature (Signer.sign_many; a
        lone command gets a plain one)."""
        sigs = iter(self.signer.sign_many([x.command.encode() for x in drafts if x.command]))
        return [self._record(x, next(sigs) if x.command else "") for x in drafts]

    def _draft(self, d: Decision, now: float, prev: str = "", parent: str = "",
               extra: tuple[tuple[str, str], ...] = (), reach: Reach | None = None,
               check_reach: bool = False, rid: str = "") -> Draft:
        """A decision's record before its command is signed: its id, what goes out now, the command's bytes."""
        pb, target = d.playbook, d.target
        rid = rid or new_record_id(target)
        command = ""
        early, send, defer = plan_send(target, d.steps, reach)
        if send and not defer and not d.resolution.reason:
            fence = protocol.fence(d.alert.fingerprint, d.alert.episode_start, pb.name, d.stage, d.mode)
            command = command_for(rid, target, send, d.resolution.context, now, pb.expire_after,
                                  d.alert.fingerprint, fence, d.alert.starts_at).to_json()
        return Draft(d, now, rid, early, tuple(send), defer, command, reach, check_reach, prev, parent, extra)

    def _record(self, x: Draft, signature: str) -> records.NewRecord:
        """A draft's DECIDE arguments, with its command's signature."""
        d, now, s = x.decision, x.now, self.settings
        pb = d.playbook
        return records.NewRecord(
            rid=x.rid, target=d.target, playbook=pb.name, mode=d.mode, steps=d.steps, alert=d.alert.as_dict(),
            episode_start=d.alert.episode_start, fingerprint=d.alert.fingerprint, now=now,
            context=d.resolution.context, detail=d.resolution.detail or "", forced_reason=d.resolution.reason or "",
            requested_by=d.requested_by, ends_at=d.alert.ends_at if d.mode == "resolved" else "",
            ends_ms=_ms_of(d.alert.ends_at, now) if d.mode == "resolved" else 0, extra=x.extra,
            guards=records.Guards(cooldown=pb.cooldown, budget=pb.max_runs or (0, 0.0), approval=pb.approval,
                                  approval_timeout=pb.approval_timeout, dry_run=pb.dry_run or s.dry_run),
            keep=records.Retention(expire_after=pb.expire_after, record_ttl=s.record_ttl, episode_ttl=s.episode_ttl,
                                   obligation_due=s.alertmanager_poll or pb.resolve_timeout,
                                   mailbox_maxlen=s.mailbox_maxlen),
            ladder=records.Ladder(stage=d.stage, parent=x.parent, prev=x.prev),
            delivery=records.Delivery(
                command=x.command, signature=signature, early=x.early,
                no_live=x.reach is not None and not x.reach.live, defer=x.defer, check_reach=x.check_reach,
                need=tuple(st.action for _, st in x.send if st.action not in BY_SERVICE) if x.check_reach else (),
                follow=d.answers_for_alert or bool(pb.notify) or s.notify or x.defer,
                visit_now=x.defer or bool(pb.notify) or s.notify or pb.silence, undo=bool(pb.on_resolved),
                verify=pb.verify if d.answers_for_alert else None),
            sealer=self.signer.seal)

    def _index_elsewhere(self, outcomes: list[Outcome], news: list[records.NewRecord], firsts: list[int]) -> None:
        """Redis Cluster: the approvals and due-target indexes (their own slots) of what DECIDE_MANY decided,
        at the due times it answered (lua/decide_many.lua writes them itself on a single Redis)."""
        due: dict[str, int] = {}
        for n, first in zip(news, firsts):
            if first >= 0:
                due[n.target.label] = min(due.get(n.target.label, first), first)
        held = {o.record_id: n.now + n.guards.approval_timeout for o, n in zip(outcomes, news)
                if o.status == RecordStatus.PENDING_APPROVAL}
        # A duplicate journals its record again (idempotent): that heals a listing lost to a crash in between.
        heal = [o.record_id for o in outcomes if o.record_id and not o.new]
        if not (due or held or heal):
            return
        pipe = self.r.pipeline(transaction=False)
        if heal:
            pipe.rpush(keys.HIST_JOURNAL, *heal)
        if held:
            pipe.zadd(keys.APPROVALS, held)
        if due:
            # Each target's earliest due time; LT never moves one later (the reconciler does that itself).
            pipe.zadd(keys.DUE, due, lt=True)
            pipe.sadd(keys.MAILBOXES, *due)
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
                    obligation_due: float) -> list:
        """Approve (release, signed anew with a fresh expiry) or reject a record held for approval.

        The release signs only what was decided: a hold whose hash no longer matches its seal (someone wrote to
        it in Redis) is ended `skipped` / `tampered` instead (verb 'tamper' of APPROVE)."""
        rec = records.load(self.r, record_id)
        if rec is None:
            return ["missing"]
        target, alert = rec.target, rec.alert
        now = time.time()
        expire_after = rec.expire_after
        text = signature = ""
        early: records.Early = ()
        send: list[tuple[int, Step]] = []
        defer = False
        if (verb == "approve" and rec.status == RecordStatus.PENDING_APPROVAL
                and not records.intact(record_id, rec.raw, self.signer)):
            verb = "tamper"
        if verb == "approve":
            early, send, defer = plan_send(target, rec.steps, self.reach([target]).get(target))
        if send and not defer:
            cmd = command_for(record_id, target, send, rec.context, now, expire_after, alert.get("fingerprint", ""),
                              records.fence_of(rec.raw, alert), alert.get("starts_at", ""))
            text = cmd.to_json()
            signature = self.signer.sign(text.encode())
        answer = run_scripts(self.r, [records.approve_call(
            self.scripts, record_id, verb=verb, now=now, by=by, comment=comment, command=text,
            signature=signature, expires_at=now + expire_after, playbook=rec.playbook,
            fingerprint=alert.get("fingerprint", ""), firing=rec.mode in (Mode.FIRING, Mode.STAGE), undo=undo,
            obligation_due=obligation_due, episode_ttl=self.settings.episode_ttl,
            maxlen=self.settings.mailbox_maxlen, early=early, defer=defer)])[0]
        answer = [str(x) for x in answer]
        if answer[0] == Reason.TAMPERED:
            self.refuse_tampered(record_id, "its approval")
        pipe = self.r.pipeline(transaction=False)
        pipe.zrem(keys.APPROVALS, record_id)
        if answer[0] == RecordStatus.DISPATCHED or rec.follow:
            first = now if rec.follow else min(now + expire_after, now + obligation_due)
            pipe.zadd(keys.DUE, {target.label: int(first * 1000)}, lt=True)
            pipe.sadd(keys.MAILBOXES, target.label)
        pipe.execute()
        return answer
