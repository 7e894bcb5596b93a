"""The reconciler: owns every record until it is terminal and true (README: Guardrails).

It runs in every service replica (a thread in each gunicorn worker) and stays correct when several run at
once or one dies: each step is one atomic script in the target's slot, and a short lease only saves work.
It expires what nobody took, offers again what a process that is gone had claimed, ends the rest lost,
expires holds nobody approved, and runs on_resolved when Alertmanager never sends a resolve.
"""
from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Sequence

import redis

from ...client.wire import keys
from ...client.wire.protocol import rfc3339
from ...client.wire.redis import run_scripts

from .. import beats, fold, goodput, history, repairs
from ..listener import Listener
from ..store import record
from ..store.scripts import Keyspace, Reconciled, load_scripts, mark_call, reconcile_call
from ..rules.alerts import alert_of_record
from ..rules.playbooks import Playbook
from ..rules.targets import Resolution
from ..prometheus import Prometheus
from .alertmanager import Alertmanager
from .deferred import Conditions
from .detections import Detections
from .dispatch import Dispatcher
from .followup import AlertView, FollowUp
from .notify import Notifier
from .plan import Decision
from .resync import Resync

log = logging.getLogger("trainmedic.reconciler")

# Targets whose RECONCILE calls share one pipeline.
BATCH = 100
# At most this share of a pass's interval goes to RECONCILE visits; follow-ups get the rest (and what the visits
# leave), so a burst of due targets never starves outcomes, stages, silences and notifications.
VISIT_SHARE = 0.6

RESET_BANNER_SECONDS = 86400.0
# How long a target's mailbox and due items outlive the reconciler's last look at it.
KEEP = 30 * 86400.0
# How often the own keys of the targets with open records are looked over for what their appliers left
# (service/listener.py hears it at once; this finds what it did not hear).
SWEEP_EVERY = 2.0
# With this few targets with open records, every pass looks them over (a few round trips).
SWEEP_ALWAYS = 200
# How often the keys every target shares are checked for what trainmedic never wrote there.
REPAIR_EVERY = 30.0
# Targets looked over per round trip.
SWEEP_BATCH = 1000


@dataclass(frozen=True)
class ReconcilerSettings:
    """How the reconciler paces itself."""

    interval: float = 1.0
    # A delivered command is lost this long after its expiry (every action is terminal by expire_after + 30 s).
    grace: float = 20.0
    # How often a delivered, unacknowledged command is checked for a process that is gone.
    recheck: float = 10.0
    history_max: int = 1_000_000
    targets_per_tick: int = 2000
    # With Alertmanager's API, an alert whose on_resolved is owed is asked about this often.
    alertmanager_poll: float = 15.0
    # A followed record whose follow-up failed (a bug, Redis trouble) is looked at again after this long.
    retry: float = 30.0
    # Where people reach the service: links in silences and notifications.
    public_url: str = "http://127.0.0.1:9095"
    notify_url: str | None = None
    # TRAINMEDIC_HANG_AFTER: a live job whose step has not moved this long gets TrainingHang.
    hang_after: float = 600.0
    # TRAINMEDIC_RESYNC_AFTER: how long Alertmanager lists an alert as active before the resync may decide it.
    resync_after: float = 300.0


@dataclass
class TickReport:
    """What one pass did (for tests, logs and benchmarks)."""

    targets: int = 0
    changed: list[tuple[str, str]] = field(default_factory=list)
    resolved: list[str] = field(default_factory=list)
    followed: int = 0
    trimmed: int = 0
    reset: bool = False
    # Decisions of detections and hangs this pass made.
    detected: int = 0
    # Records the resync made (alerts active in Alertmanager that Redis had no episode of).
    resynced: int = 0
    # As many targets were due as one pass takes: the next pass starts at once.
    full: bool = False


class Reconciler:
    """Brings due records to the truth, one target at a time, on a timer or when called."""

    def __init__(self, r: Any, dispatcher: Dispatcher, playbooks: Sequence[Playbook],
                 settings: ReconcilerSettings = ReconcilerSettings(), alertmanager: Alertmanager | None = None,
                 on_change: Callable[[str, str], None] | None = None, prometheus: Prometheus | None = None,
                 detections: Detections | None = None):
        self.r = r
        self.dispatcher = dispatcher
        self.playbooks = {p.name: p for p in playbooks}
        self.settings = settings
        self.alertmanager = alertmanager
        self.on_change = on_change
        self.keyspace = Keyspace(r)
        self.followup = FollowUp(r, dispatcher, self.playbooks, alertmanager, Notifier(settings.notify_url),
                                 settings.public_url, Conditions(r, dispatcher, prometheus))
        # Jobs' detections and hangs: the listener decides detections at once; each pass decides those of the
        # jobs that marked themselves due (a wake-up nobody heard) and checks for hangs.
        self.detections = detections or Detections(r, dispatcher, playbooks, alertmanager, settings.hang_after,
                                                   settings.public_url)
        self.resync = Resync(r, dispatcher, playbooks, alertmanager, settings.resync_after)
        self.listener = Listener(r, self.detections.handle)
        self.identity = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._next_beats = 0.0
        self._next_sweep = 0.0
        self._next_repair = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False

    # -- the keyspace's epoch: a Redis that came back empty is noticed, counted and shown
    def mark_epoch(self) -> None:
        """Write the epoch marker of a keyspace that has none (the service's first start)."""
        self.r.set(keys.EPOCH, rfc3339(), nx=True)

    def _check_epoch(self) -> bool:
        """Whether Redis came back without trainmedic's data since the last pass (and count it once if so)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.exists(keys.EPOCH)
        pipe.hget(keys.MARK, "n")
        pipe.get(keys.MARK_SEEN)
        epoch, mark, seen = pipe.execute()
        if not epoch:
            if not self.r.set(keys.EPOCH, rfc3339(), nx=True):
                return False  # another reconciler saw it first
            why = ("records, episodes and cooldowns before now are gone (restarted without persistence, flushed, or "
                   "a failover to an empty replica)")
        elif seen is not None and (mark is None or int(mark) < int(seen)):
            why = ("what its scripts wrote (records, episodes, mailboxes) is gone while plain writes survived: Redis "
                   "dropped the scripts' transactions when it loaded its AOF (an ACL file whose default user may not "
                   "run every command; README: Durability)")
        else:
            why = ""
        # The pass's mark, written by a script, and the copy kept with a plain SET.
        self.r.set(keys.MARK_SEEN, int(run_scripts(self.r, [mark_call(time.time())])[0]))
        if not why:
            return False
        pipe = self.r.pipeline(transaction=False)
        pipe.incr(keys.RESETS)
        pipe.set(keys.RESET_AT, rfc3339(), ex=int(RESET_BANNER_SECONDS))
        pipe.execute()
        log.error("Redis came back without trainmedic's data: %s; the appliers' own state still keeps any command "
                  "from being applied twice", why)
        return True

    # -- one pass
    def tick(self, now: float | None = None) -> TickReport:
        """One pass over every target with something due (call it directly in tests). A key that every target
        shares holding what trainmedic never wrote there is repaired (service/repairs.py), and the pass made
        again: the reconciler is never stuck on it."""
        now = time.time() if now is None else now
        if now >= self._next_repair:
            self._next_repair = now + REPAIR_EVERY
            repairs.check_shared(self.r)
        try:
            return self._tick(now)
        except redis.ResponseError as exc:
            if not repairs.fixable(exc):
                raise
            repairs.check_shared(self.r)
            return self._tick(now)

    def _tick(self, now: float) -> TickReport:
        report = TickReport(reset=self._check_epoch())
        if load_scripts(self.r):
            log.info("loaded the scripts into Redis (it had none: a restart), for trainers and agents to run")
        view = AlertView(self.alertmanager)
        # Every due target's RECONCILE first, page after page, each target once a pass (for VISIT_SHARE of an
        # interval at most: the rest is the next pass's), so that every action is terminal within its bound
        # however large a burst; then follow-ups, on_resolved and detections with the time left, never none
        # (what is left over stays due, and the next pass starts at once).
        if now >= self._next_sweep or self.r.zcard(keys.DUE) <= SWEEP_ALWAYS:
            self._next_sweep = now + SWEEP_EVERY
            self._sweep(now)
        start = time.monotonic()
        until = start + self.settings.interval
        work: dict[str, tuple[keys.Target, Reconciled]] = {}
        while self._visit(now, report, work) and time.monotonic() < start + self.settings.interval * VISIT_SHARE:
            pass
        if not self._after(now, view, report, work, until):
            report.full = True
        if report.changed:
            # A hold that ended here (nobody approved it in time) is no longer waiting for a person.
            self.r.zrem(keys.APPROVALS, *(rid for rid, _ in report.changed))
        if now >= self._next_beats:
            self._next_beats = now + beats.REFRESH_EVERY
            self._live(now)
        report.detected += len(self.detections.scan_hangs(now))
        self._goodput(now)
        if self.resync.due():
            report.resynced = len(self.resync.run(now))
        report.trimmed = self._retention(now)
        for rid, status in report.changed:
            if self.on_change is not None:
                self.on_change(rid, status)
        return report

    def _live(self, now: float) -> None:
        """Every few seconds: the live targets from their heartbeats, and the breakers' leases of the
        remediations still open."""
        beats.refresh(self.r, now)
        self.dispatcher.breaker.renew(list(self.playbooks.values()), now, self._still_open)

    def _goodput(self, now: float) -> None:
        """The jobs' time by kind, from their heartbeats (service/goodput.py)."""
        goodput.fold_known(self.r, now)

    def _sweep(self, now: float) -> None:
        """What the appliers of the targets with open records left that the listener did not hear of (it was not
        running, or missed it): a journal or counts to fold in, a record due sooner than the target is. Only a
        target with an open record can have an ack to fold (DUE lists every one)."""
        now_ms = int(now * 1000)
        labels = [str(x) for x in self.r.zrangebyscore(keys.DUE, f"({now_ms}", "+inf")]
        for start in range(0, len(labels), SWEEP_BATCH):
            batch = [(label, t) for label, t in ((x, keys.parse_label(x)) for x in labels[start:start + SWEEP_BATCH])
                     if t is not None]
            if not batch:
                continue
            pipe = self.r.pipeline(transaction=False)
            for _, t in batch:
                pipe.exists(keys.journal(t), keys.target_metrics(t))
                pipe.zrange(keys.due_items(t), 0, 0, withscores=True)
            got = pipe.execute()
            due_at = self.r.zmscore(keys.DUE, [label for label, _ in batch])
            dirty = [label for (label, _), n in zip(batch, got[::2]) if n]
            sooner = {label: int(first[0][1]) for (label, _), first, at in zip(batch, got[1::2], due_at)
                      if first and (at is None or first[0][1] < at)}
            pipe = self.r.pipeline(transaction=False)
            if dirty:
                pipe.sadd(keys.HIST_DIRTY, *dirty)
                pipe.zadd(keys.DUE, dict.fromkeys(dirty, now_ms), lt=True)
            if sooner:
                pipe.zadd(keys.DUE, sooner, lt=True)
            pipe.execute()

    def _visit(self, now: float, report: TickReport, work: dict[str, tuple[keys.Target, Reconciled]]) -> bool:
        """RECONCILE one page of the due targets, in pipelines of BATCH, and set their due times (a few round
        trips a batch); what each needs next goes into `work`. True when the page was full (more may be due).

        A target with follow-ups left stays due, at its earliest item: a page leaves out the targets this pass
        visited already, so the pages of a burst move on through the rest."""
        page = self.settings.targets_per_tick
        due = [label for label in self.r.zrangebyscore(keys.DUE, "-inf", int(now * 1000), start=0,
                                                         num=page + len(work)) if label not in work][:page]
        report.full = len(due) >= page
        parsed = [(label, keys.parse_label(label)) for label in due]
        if bad := [label for label, t in parsed if t is None]:
            self.r.zrem(keys.DUE, *bad)
        targets = [(label, t) for label, t in parsed if t is not None]
        for start in range(0, len(targets), BATCH):
            batch = targets[start:start + BATCH]
            # What the targets' own scripts left for the service (acks' history entries and counts) first.
            fold.fold(self.r, [t for _, t in batch])
            answers = self.keyspace.run([reconcile_call(
                self.keyspace, t, now, grace=self.settings.grace, recheck=self.settings.recheck, keep=KEEP)
                for _, t in batch], (t for _, t in batch))
            for (label, target), answer in zip(batch, answers):
                done = Reconciled.of(answer)
                report.targets += 1
                report.changed.extend(done.changed)
                work[label] = (target, done)
            self._reschedule(batch)
        return report.full

    def _after(self, now: float, view: AlertView, report: TickReport,
               work: dict[str, tuple[keys.Target, Reconciled]], until: float) -> bool:
        """Follow-ups and on_resolved of the visited targets until `until` (the first target's whatever the
        time), and their jobs' detections; False when time ran out before the last target's."""
        touched: list[tuple[str, keys.Target]] = []
        finished = True
        for label, (target, done) in work.items():
            if touched and time.monotonic() >= until:
                finished = False
                break
            for member in done.obligations:
                rid = self._obligation(target, member, now, view)
                if rid:
                    report.resolved.append(rid)
            for rid in done.follow:
                self._follow(target, rid, now, view)
            report.followed += len(done.follow)
            if done.obligations or done.follow:
                touched.append((label, target))
        jobs = [t for t, _ in work.values() if t.kind == "job"]
        for target in self.detections.waiting(jobs):
            report.detected += len(self.detections.handle(target))
        for start in range(0, len(touched), BATCH):
            self._reschedule(touched[start:start + BATCH])
        return finished

    def _reschedule(self, batch: list[tuple[str, keys.Target]]) -> None:
        """Set each target's due time from its own items, in three round trips for the batch. A webhook may add
        an earlier item meanwhile: its ZADD LT either lands after ours, or is restored by the second read."""
        pipe = self.r.pipeline(transaction=False)
        for _, target in batch:
            pipe.zrange(keys.due_items(target), 0, 0, withscores=True)
        firsts = pipe.execute()
        pipe = self.r.pipeline(transaction=False)
        for (label, _), first in zip(batch, firsts):
            if first:
                pipe.zadd(keys.DUE, {label: int(first[0][1])}, xx=True)
            else:
                pipe.zrem(keys.DUE, label)
        for _, target in batch:
            pipe.zrange(keys.due_items(target), 0, 0, withscores=True)
        again = pipe.execute()[len(batch):]
        late = {label: int(a[0][1]) for (label, _), a in zip(batch, again) if a}
        if late:
            self.r.zadd(keys.DUE, late, lt=True)

    def _follow(self, target: keys.Target, rid: str, now: float, view: AlertView) -> None:
        try:
            self.followup.run(target, rid, now, view)
        except redis.RedisError:
            raise
        except Exception:  # one record's bug must not hold up the others
            log.exception("reconciler: following up %s failed; trying again in %.0fs", rid, self.settings.retry,
                          extra={"remediation_id": rid})
            self.r.zadd(keys.due_items(target), {rid: int((now + self.settings.retry) * 1000)})

    def _obligation(self, target: keys.Target, member: str, now: float, view: AlertView) -> str | None:
        """An alert whose on_resolved is owed: run it when the alert is over; else look again later."""
        _, pb_name, fingerprint = member.split("|", 2)
        pb = self.playbooks.get(pb_name)
        ob_key = keys.obligation(target, pb_name, fingerprint)
        ob = self.r.hgetall(ob_key)
        if not ob or pb is None:
            # Discharged meanwhile, or its playbook is gone from this service: nothing to run.
            self.r.zrem(keys.due_items(target), member)
            return None
        seen = int(ob.get("seen") or 0) / 1000
        state = view.active(fingerprint)
        if state is not None:
            over = not state
            later = now + self.settings.alertmanager_poll
        else:
            over = now >= seen + pb.resolve_timeout
            later = seen + pb.resolve_timeout
            if self.alertmanager is not None:
                # Alertmanager could not say now (unreachable, or up too briefly to trust): ask it again
                # soon, not only when resolve_timeout has passed.
                later = min(later, now + self.settings.alertmanager_poll)
        if not over:
            self.r.zadd(keys.due_items(target), {member: int(later * 1000)})
            return None
        rec, tampered = self._sealed_record(target, ob.get("rid") or "", pb_name, fingerprint)
        alert = alert_of_record(rec.alert_dict if rec else {}, "resolved", fingerprint)
        resolution = Resolution(target, rec.context if rec else {})
        if tampered:
            resolution = Resolution(target, {}, "tampered", "The record this on_resolved undoes was changed in "
                                                            "Redis after it was decided, so nothing was sent.")
        outcome = self.dispatcher.decide_one(
            Decision(pb, "timeout", alert, resolution, requested_by="reconciler"), now)
        log.info("on_resolved of %s for %s ran without a resolve notification (%s): %s", pb_name, target.label,
                 "Alertmanager no longer lists the alert" if state is not None else "resolve_timeout passed",
                 outcome.status, extra={"remediation_id": outcome.record_id, "fingerprint": fingerprint,
                                        "target": target.label})
        return outcome.record_id if outcome.new else None

    def _sealed_record(self, target: keys.Target, rid: str, playbook: str,
                       fingerprint: str) -> tuple[record.StoredRecord | None, bool]:
        """(the firing record an obligation names, whether it was tampered with): (None, False) when there is
        none or it is gone; (None, True), refused as tampered, when it no longer holds what was decided."""
        if not rid:
            return None, False
        try:
            rec = record.load(self.r, rid) if keys.target_of_record(rid) == target else None
            if rec is None and keys.target_of_record(rid) == target:
                return None, False  # gone (retention): nothing to check it against
        except (ValueError, record.BadRecord):
            rec = None
        if rec is None or not rec.intact(self.dispatcher.signer) or (rec.playbook, rec.fingerprint) != (
                playbook, fingerprint):
            self.dispatcher.refuse_tampered(rid, "the context of its on_resolved")
            return None, True
        return rec, False

    def _still_open(self, ids: list[str]) -> set[str]:
        """Which of these first records of ladders are still open remediations (the breaker renews their claims):
        there, not ended, and not skipped."""
        ids = [rid for rid in ids if keys.RECORD_ID_RE.match(rid)]
        if not ids:
            return set()
        pipe = self.r.pipeline(transaction=False)
        for rid in ids:
            pipe.hmget(keys.record(rid), "status", "ladder_end")
        return {rid for rid, (status, ended) in zip(ids, pipe.execute())
                if status and not ended and status not in ("skipped", "dry_run")}

    def _retention(self, now: float) -> int:
        """Delete the oldest records beyond TRAINMEDIC_HISTORY_MAX or 30 days, and trim the indexes that have no
        TTL of their own by age."""
        # Holds past their approval time (also those a resolve ended) are no longer pending approval.
        self.r.zremrangebyscore(keys.APPROVALS, "-inf", int(now * 1000))
        # The history index: index what the journal holds, delete records past the count or the age.
        return history.trim(self.r, self.settings.history_max, now=now)

    # -- running in the background
    def start(self) -> Reconciler:
        """Tick every `interval` seconds in a daemon thread until stop()."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="trainmedic-reconciler", daemon=True)
            self._thread.start()
            self.listener.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self.listener.stop(timeout)
        if self._thread is not None:
            self._thread.join(timeout)

    def _leader(self) -> bool:
        # One reconciler ticks at a time; another takes over when this one's lease lapses.
        ttl = int(self.settings.interval * 3000)
        if self.r.set(keys.RECONCILER_LEASE, self.identity, nx=True, px=ttl):
            return True
        if self.r.get(keys.RECONCILER_LEASE) == self.identity:
            self.r.pexpire(keys.RECONCILER_LEASE, ttl)
            return True
        return False

    def _run(self) -> None:
        wait = self.settings.interval
        while not self._stop.wait(wait):
            wait = self.settings.interval
            try:
                if self._leader() and self.tick().full:
                    wait = 0.0  # still behind: the next pass starts at once
                if self._failing:
                    self._failing = False
                    log.info("reconciler: Redis reachable again")
            except redis.RedisError as exc:
                if not self._failing:
                    self._failing = True
                    log.warning("reconciler: Redis unavailable (%s); retrying", exc)
            except Exception:  # a bug must not stop reconciling for good
                log.exception("reconciler: a pass failed")

