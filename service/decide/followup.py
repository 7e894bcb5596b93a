"""After a remediation is decided: its outcome, its ladder's next stage, its silence, and who hears of it
(README: "Did it work? Outcomes, ladders, silences, notifications").

The reconciler runs `FollowUp.run` for each record its RECONCILE script lists as due. Every change is one
atomic step in the record's hash slot: VERDICT decides an outcome once, DECIDE in stage mode makes a stage
once (the previous record's `next`), and HSETNX marks make a ladder end, a silence and each notification
happen once, so replicas that race never do anything twice. Alertmanager, Prometheus and notification hooks
are only ever called from here, never from the webhook.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any
from collections.abc import Mapping

from ...client.wire import keys
from ...client.wire.protocol import parse_rfc3339, rfc3339
from ...client.wire.status import ActionStatus, Mode, Outcome, Reason, RecordStatus, Requester

from .. import outcomes, repairs
from ..store import record
from ..store.decision import state_ttl
from ..store.record import StoredRecord
from ..store.scripts import verdict_call
from ..store.seals import silence_text
from ..http import HttpError
from ..rules.alerts import alert_of_record
from ..rules.playbooks import Playbook
from ..rules.targets import Resolution
from .alertmanager import Alertmanager
from .deferred import Conditions
from .dispatch import Dispatcher
from .notify import Notice, Notifier, ordered
from .plan import Decision

log = logging.getLogger("trainmedic.followup")

# Without Alertmanager's API, a pending outcome with no resolve this long after `verify` is ineffective.
INEFFECTIVE_AFTER = 300.0
# A silenced alert sends nothing, not even its resolve: its ladder asks Alertmanager this often.
SILENCED_POLL = 15.0
# Applied nothing: such a stage ends its ladder unresolved (a rejection is a person's choice, not a failure).
APPLIED_NOTHING = (RecordStatus.FAILED, RecordStatus.LOST, RecordStatus.EXPIRED, RecordStatus.SKIPPED)
# A silence claimed by a reconciler that stopped before saying how it went is given up after this long.
SILENCE_CLAIM_TIMEOUT = 60.0


class AlertView:
    """Whether Alertmanager holds an alert as active, asked at most once per pass and only when needed."""

    def __init__(self, alertmanager: Alertmanager | None):
        self.alertmanager = alertmanager
        self._active: set[str] | None = None
        self._asked = False

    @property
    def configured(self) -> bool:
        return self.alertmanager is not None

    def active(self, fingerprint: str) -> bool | None:
        """True or False, or None when it cannot be known (no API, unreachable, just restarted)."""
        if self.alertmanager is None:
            return None
        if not self._asked:
            self._active, self._asked = self.alertmanager.active_fingerprints(), True
        return None if self._active is None else fingerprint in self._active


@dataclass(frozen=True)
class Resolved:
    """The alert's resolve, as the episode keeps it."""

    at: str
    ms: int


class FollowUp:
    """Brings one followed record forward; see the module's docstring."""

    def __init__(self, r: Any, dispatcher: Dispatcher, playbooks: Mapping[str, Playbook],
                 alertmanager: Alertmanager | None, notifier: Notifier, public_url: str,
                 conditions: Conditions | None = None):
        self.r = r
        self.conditions = conditions or Conditions(r, dispatcher, None)
        self.dispatcher = dispatcher
        self.playbooks = playbooks
        self.alertmanager = alertmanager
        self.notifier = notifier
        self.public_url = public_url.rstrip("/")

    def link(self, record_id: str) -> str:
        return f"{self.public_url}/records/{record_id}"

    def run(self, target: keys.Target, rid: str, now: float, view: AlertView) -> None:
        """Do what is due for the record, then set when it is next due (or stop following it)."""
        rec = self._load(rid)
        if rec is not None and rec.waiting_conditions and rec.status == RecordStatus.DISPATCHED:
            ran = self.conditions.run(target, rec, now, self.playbooks.get(rec.playbook))
            rec = self._load(rid) if ran else rec
        pb = self.playbooks.get(rec.playbook) if rec is not None else None
        if rec is None or not rec.follow or pb is None:
            self._stop(target, rid)
            return
        status = rec.status
        if rec.breaker_opened and rec.reason == Reason.BREAKER_OPEN:
            # The refusal that opened its playbook's breaker: one notification, nothing else to follow.
            self._notify(rec, pb, ["breaker_open"])
            self._stop(target, rid)
            return
        if status == RecordStatus.SKIPPED and rec.reason == Reason.NO_ACTIONS:
            # A playbook with nothing to run (TrainingHang's): one notification, nothing else to follow.
            self._notify(rec, pb, ["no_actions"])
            self._stop(target, rid)
            return
        if status == RecordStatus.PENDING_APPROVAL:
            self._notify(rec, pb, ["held"])
            return  # RECONCILE keeps it due at its approval deadline
        if self._silence_wanted(rec, pb) and status in (RecordStatus.DISPATCHED, RecordStatus.APPLIED,
                                                        RecordStatus.PARTIALLY_APPLIED):
            rec = dataclasses.replace(rec, silence_id=self._make_silence(rec, pb, now))
        if status == RecordStatus.DISPATCHED:
            return  # RECONCILE keeps it due at its expiry
        work = _Pass(self, target, rec, pb, now, view)
        due = work.run()
        if due is None:
            self._stop(target, rid)
        else:
            self.r.zadd(keys.due_items(target), {rid: int(due * 1000)})

    def _load(self, rid: str) -> StoredRecord | None:
        """The record, or None when it is gone or does not read as one (counted as a repair: nothing follows)."""
        try:
            return record.load(self.r, rid)
        except record.BadRecord as exc:
            repairs.note(self.r, f"record {rid} does not read as one ({exc}); the reconciler stops following it")
            return None

    def _stop(self, target: keys.Target, rid: str) -> None:
        record.stop_following(self.r, rid)
        self.r.zrem(keys.due_items(target), rid)

    # -- notifications, silences
    def _notify(self, rec: StoredRecord, pb: Playbook, events: list[str]) -> None:
        """Send one message for the events not sent before (each event of a record is sent at most once)."""
        url = self.notifier.url_for(pb.notify)
        if not url or not events:
            return
        fresh = [e for e in ordered(events) if record.mark_once(self.r, rec.id, f"notified:{e}")]
        if not fresh:
            return
        notice = Notice(rec.id, pb.name, rec.target.label, rec.alert.alertname, rec.stage, tuple(fresh),
                        self.link(rec.id))
        self.notifier.send(url, notice)

    def _silence_wanted(self, rec: StoredRecord, pb: Playbook) -> bool:
        return (pb.silence and self.alertmanager is not None and not rec.stage and not rec.silence_id
                and not rec.silence_error and not rec.ladder_end)

    def _make_silence(self, rec: StoredRecord, pb: Playbook, now: float) -> str | None:
        """Silence the alert for the ladder's length, once; its id (None when not made, or made elsewhere)."""
        rid = rec.id
        if not rec.intact(self.dispatcher.signer):
            # The silence's matchers are the record's alert labels: only as decided.
            if record.mark_once(self.r, rid, "silence_error", "the record was changed in Redis after it was "
                                                              "decided, so no silence was made"):
                self.dispatcher.refuse_tampered(rid, "its silence")
            return None
        if not record.mark_once(self.r, rid, "silence_claim", str(int(now * 1000))):
            claimed = int(record.field_of(self.r, rid, "silence_claim") or 0) / 1000
            if now - claimed > SILENCE_CLAIM_TIMEOUT and record.field_of(self.r, rid, "silence_id") is None:
                record.mark_once(self.r, rid, "silence_error", "the reconciler stopped while it was making the silence")
            return record.field_of(self.r, rid, "silence_id")
        assert self.alertmanager is not None
        seconds = max(60.0, rec.dispatched_ms / 1000 + pb.silence_seconds - now)
        try:
            sid = self.alertmanager.create_silence(dict(rec.alert.labels), seconds,
                                                   f"trainmedic is remediating: {self.link(rid)}")
        except HttpError as exc:
            log.warning("silence for %s not made: %s", rid, exc.message, extra={"remediation_id": rid})
            record.set_marks(self.r, rid, silence_error=f"the silence could not be made: {exc.message}")
            return None
        record.set_marks(self.r, rid, silence_id=sid, silence_seal=self.dispatcher.signer.seal(silence_text(rid, sid)))
        log.info("silenced alert %s until the ladder ends", rec.alert.alertname, extra={"remediation_id": rid})
        return sid

    def _expire_silence(self, first: StoredRecord) -> None:
        sid = first.silence_id
        if not sid or self.alertmanager is None:
            return
        if not self.dispatcher.signer.sealed(silence_text(first.id, sid), first.silence_seal):
            # Not the silence this service made for the ladder (someone wrote the id): it is left alone, and
            # the one it made ends by itself at its endsAt.
            self.dispatcher.refuse_tampered(first.id, f"expiring silence {sid}")
            return
        try:
            self.alertmanager.expire_silence(sid)
        except HttpError as exc:
            # It still ends by itself at its endsAt.
            log.warning("silence %s not expired early: %s", sid, exc.message, extra={"remediation_id": first.id})

    # -- outcomes, stages
    def verdict(self, rec: StoredRecord, pb: Playbook, status: str, now: float, resolved_at: str | None = None,
                time_to_resolve: float | None = None) -> bool:
        ks = self.dispatcher.keyspace
        if not ks.run([verdict_call(ks, rec.id, status, resolved_at, time_to_resolve)], [rec.target])[0]:
            return False
        self.count(rec, pb, status, now, time_to_resolve)
        log.info("outcome of %s: %s%s", rec.id, status,
                 f" in {time_to_resolve:.1f}s" if time_to_resolve is not None else "",
                 extra={"remediation_id": rec.id, "playbook": pb.name})
        return True

    def count(self, rec: StoredRecord, pb: Playbook, status: str, now: float,
              time_to_resolve: float | None = None) -> None:
        """Note an outcome for GET /playbooks and /metrics, once per record and outcome."""
        if record.mark_once(self.r, rec.id, f"counted:{status}"):
            outcomes.note(self.r, pb.name, rec.id, status, now, time_to_resolve)

    def next_stage(self, target: keys.Target, rec: StoredRecord, first: StoredRecord, pb: Playbook,
                   stage: int, now: float) -> str:
        """Make the ladder's next stage after record rec: DECIDE's status ('closed' when the episode ended), or
        'tampered' (nothing made) when the first record or rec no longer holds what was decided (the stage's
        alert and context come from the first, its playbook and number from rec)."""
        for one in (first, rec) if rec.id != first.id else (first,):
            if not one.intact(self.dispatcher.signer):
                self.dispatcher.refuse_tampered(one.id, f"escalation stage {stage}")
                return Reason.TAMPERED
        alert = alert_of_record(first.alert_dict, "firing", first.fingerprint)
        extra = (("silence_id", first.silence_id),) if first.silence_id else ()
        d = Decision(pb, Mode.STAGE, alert, Resolution(target, first.context), requested_by=Requester.RECONCILER,
                     stage=stage)
        o = self.dispatcher.decide_one(d, now, prev=rec.id, parent=first.id, extra=extra)
        log.info("escalation stage %d of %s: %s", stage, first.id, o.status,
                 extra={"remediation_id": o.record_id, "playbook": pb.name, "target": target.label})
        return o.status

    def note_resolved(self, target: keys.Target, pb: Playbook, fingerprint: str, start: str, first_id: str,
                      now: float) -> Resolved:
        """Keep a resolve learnt from Alertmanager's API on the episode, as a resolve notification would, and
        have every followed record of the ladder looked at now."""
        state = keys.target_state(target)
        names = keys.episode_fields(pb.name, fingerprint, "res_start", "res_ms", "res_at")
        at, ms = rfc3339(now), int(now * 1000)
        current = self.r.hmget(state, names)
        if current[0] and current[0] >= start and current[1]:
            return Resolved(current[2] or at, int(current[1]))
        keep = state_ttl(self.dispatcher.settings.episode_ttl, pb.cooldown, (pb.max_runs or (0, 0.0))[1])
        until = ms + int(keep * 1000) + 86_400_000
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(state, mapping=dict(zip(names, (start, ms, at))))
        if int(self.r.hget(state, "x") or 0) < until - 86_400_000:
            pipe.hset(state, "x", until)
            pipe.pexpire(state, until - ms)
        rid: str | None = first_id
        hops = 0
        while rid and hops < 64:
            pipe.zadd(keys.due_items(target), {rid: ms}, xx=True)
            rid, hops = record.field_of(self.r, rid, "next"), hops + 1
        pipe.execute()
        return Resolved(at, ms)

    def end_ladder(self, first: StoredRecord, pb: Playbook, how: str, events: list[str],
                   now: float | None = None) -> None:
        """End the ladder once: expire its silence, and say so when it ended unresolved."""
        if not record.mark_once(self.r, first.id, "ladder_end", how):
            return
        if pb.max_active:
            # The ladder's remediation is no longer open: its place under max_active is free.
            self.dispatcher.breaker.release([(pb, first.id)], now)
        log.info("ladder of %s ended: %s", first.id, how, extra={"remediation_id": first.id})
        self._expire_silence(first)
        if how == "unresolved":
            events.append("unresolved")


class _Pass:
    """One look at one settled (or dry-run) record: what is due now, and when to look again."""

    def __init__(self, f: FollowUp, target: keys.Target, rec: StoredRecord, pb: Playbook, now: float,
                 view: AlertView):
        self.f, self.target, self.rec, self.pb, self.now, self.view = f, target, rec, pb, now, view
        self.fingerprint = rec.fingerprint
        self.first = rec if rec.parent is None else (f._load(rec.parent) or rec)
        self.events: list[str] = []
        self.due: list[float] = []
        self._active: bool | None = None
        self._asked = False

    def active(self) -> bool | None:
        if not self._asked:
            self._active, self._asked = self.view.active(self.fingerprint), True
        return self._active

    def applied_at(self) -> float:
        """The last ack of an applied action (as the record shows it), else when the record settled or was made
        (a dry run): what time to resolve and a stage's `after` count from."""
        times = [parse_rfc3339(a.acked_at) for a in self.rec.actions if a.status == ActionStatus.APPLIED]
        known = [t for t in times if t is not None]
        return max(known) if known else (self.rec.settled_ms or self.rec.created_ms) / 1000

    def resolved(self) -> Resolved | None:
        """The resolve of this record's episode (or of a later one), from the resolve notification."""
        ep = self.f.r.hmget(keys.target_state(self.target),
                            keys.episode_fields(self.pb.name, self.fingerprint, "res_start", "res_ms", "res_at"))
        start = self.rec.start
        if ep[0] and start and ep[0] >= start and ep[1]:
            return Resolved(ep[2] or "", int(ep[1]))
        return None

    def silenced(self) -> bool:
        """The ladder's alert is silenced by trainmedic: no resolve notification will come."""
        return bool(self.first.silence_id) and not self.first.ladder_end and self.view.configured

    def run(self) -> float | None:
        status = self.rec.status
        if status in (RecordStatus.FAILED, RecordStatus.LOST):
            self.events.append(status)
        res = self.resolved()
        outcome = None
        if self.rec.outcome is not None:
            outcome, res = self.outcome(self.rec.outcome.status, res)
        if self.rec.verify_ms is not None and self.rec.next is None and not self.first.ladder_end:
            self.ladder(status, outcome, res)
        self.f._notify(self.rec, self.pb, self.events)
        return min(self.due) if self.due else None

    def gone(self) -> Resolved | None:
        """Alertmanager no longer lists the alert: note the resolve on the episode (now, as far as we know),
        so every record of the ladder is decided by the same resolve."""
        if self.active() is not False:
            return None
        return self.f.note_resolved(self.target, self.pb, self.fingerprint, self.rec.start, self.first.id, self.now)

    def outcome(self, current: str, res: Resolved | None) -> tuple[str, Resolved | None]:
        """Decide a pending outcome when it can be; count the others once. Returns the outcome now."""
        rec, f, now = self.rec, self.f, self.now
        if current != Outcome.PENDING:
            f.count(rec, self.pb, current, now)
            return current, res
        f.count(rec, self.pb, Outcome.PENDING, now)
        applied = self.applied_at()
        deadline = applied + (rec.verify_ms or 0) / 1000
        polling = self.silenced()
        if res is None and (now >= deadline or polling):
            res = self.gone()
        if res is not None:
            f.verdict(rec, self.pb, Outcome.EFFECTIVE, now, res.at, max(0.0, res.ms / 1000 - applied))
            return Outcome.EFFECTIVE, res
        if now >= deadline and (self.active() is True or now >= deadline + INEFFECTIVE_AFTER):
            f.verdict(rec, self.pb, Outcome.INEFFECTIVE, now)
            self.events.append("ineffective")
            return Outcome.INEFFECTIVE, res
        later = deadline if now < deadline else deadline + INEFFECTIVE_AFTER
        self.due.append(min(later, now + SILENCED_POLL) if polling else later)
        return Outcome.PENDING, res

    def ladder(self, status: str, outcome: str | None, res: Resolved | None) -> None:
        """The last record of a ladder: end it, or make its next stage when that is due."""
        f, pb, now = self.f, self.pb, self.now
        if res is not None:
            f.end_ladder(self.first, pb, "resolved", self.events, now)
        elif status in APPLIED_NOTHING:
            reason = self.rec.reason or ""
            ends: dict[str, str] = {Reason.REJECTED: "rejected", Reason.RESOLVED_BEFORE_APPROVAL: "resolved"}
            how = ends.get(reason, "unresolved")
            f.end_ladder(self.first, pb, how, self.events, now)
        elif self.rec.stage < len(pb.escalate):
            base = self.applied_at()
            at = base + pb.escalate[self.rec.stage].after
            if now < at:
                self.due.append(min(at, now + SILENCED_POLL) if self.silenced() else at)
                if self.silenced() and self.gone():
                    f.end_ladder(self.first, pb, "resolved", self.events, now)
            elif self.gone():
                f.end_ladder(self.first, pb, "resolved", self.events, now)
            else:
                made = f.next_stage(self.target, self.rec, self.first, pb, self.rec.stage + 1, now)
                if made == "closed":
                    # The episode is over: resolved, or replaced by a later one of the same alert.
                    f.end_ladder(self.first, pb, "resolved" if self.resolved() else "superseded", self.events, now)
                elif made == Reason.TAMPERED:
                    f.end_ladder(self.first, pb, "tampered", self.events, now)
        elif status == RecordStatus.DRY_RUN:
            f.end_ladder(self.first, pb, "dry_run", self.events, now)
        elif outcome in (Outcome.INEFFECTIVE, Outcome.UNKNOWN):
            f.end_ladder(self.first, pb, "unresolved", self.events, now)
