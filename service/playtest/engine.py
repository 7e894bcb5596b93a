"""The service's own decisions on a virtual clock: what `trainmedic test` and `trainmedic replay` run.

The engine holds the objects the service runs — the webhook's plan and the Dispatcher (the DECIDE scripts),
the Reconciler's passes (expiry, approval timeouts, outcomes, ladders, resolve_timeout, conditions), and
approvals (Dispatcher.decide_held) — and plays the appliers through their own Mailbox calls (claim, then the
ACK script), on a scratch Redis it starts and removes. It decides nothing itself: it sets the clock, hands
notifications in, and answers commands. The reconciler is stepped at exactly the instants something falls
due (keys.DUE), so hours of virtual time cost a handful of passes.
"""
from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import Any
from collections.abc import Mapping, Sequence

from ...client.receiver.mailbox import Mailbox
from ...client.wire import keys
from ...client.wire.protocol import LIVE_WINDOW, Ack, rfc3339
from ...client.wire.signing import Signer, Verifier
from ...client.wire.status import RecordStatus

from ..decide.detections import Detections, fingerprint
from ..decide.dispatch import DispatchSettings, Dispatcher, Outcome
from ..decide.notify import Notice, Notifier
from ..decide.plan import plan
from ..decide.reconciler import Reconciler, ReconcilerSettings
from ..listener import due_now
from ..prometheus import Prometheus
from ..rules.alerts import parse_group
from ..rules.playbooks import Playbook
from ..store import record as records
from ..store.decision import NewRecord
from ..store.scripts import load_scripts
from .outside import Answer, Live

# Heartbeat keys expire in Redis's own time, which barely moves while a test runs. Liveness as the service
# reads it (keys.live: when each target's heartbeats stop counting) follows the virtual clock: a process that
# heartbeats every few seconds keeps it a LIVE_WINDOW ahead of now at all times, which the engine writes
# KEEP_LIVE ahead at once (a few writes a virtual day instead of thousands).
REAL_TTL = 86400.0
KEEP_LIVE = 3600.0
VIRTUAL_LEASE = 10 * 365 * 86400.0
# Passes in a row that find something still due that a pass before them left due: the engine gives up (a
# follow-up that never settles), rather than crawl on a millisecond at a time.
MAX_PASSES = 1000
# Who approves and rejects in a test.
PERSON = "trainmedic-test"
# What DECIDE answers when it sent no command.
QUIET = frozenset({RecordStatus.SKIPPED, RecordStatus.PENDING_APPROVAL, RecordStatus.DRY_RUN, "duplicate", "stale",
                   "closed"})
# Alertmanager's endsAt of a firing alert (the zero time).
NOT_ENDED = "0001-01-01T00:00:00Z"


class EngineError(Exception):
    """The service's path could not be run to the end; the message is one sentence."""


def ms(seconds: float) -> int:
    """Whole milliseconds (what the scripts count in)."""
    return int(seconds * 1000)


def instant(ms: int) -> float:
    """The clock reading of a millisecond: a hair past it, so that every reader's int(seconds * 1000) is it."""
    return ms / 1000 + 0.0001


@dataclass(frozen=True)
class Made:
    """A record the service made, in the order it made them, with what DECIDE answered at the time."""

    record_id: str
    outcome: Outcome
    at: float


class _Recording(Dispatcher):
    """The service's Dispatcher, noting every record it makes (webhook, stages, on_resolved, checkpoints) and
    the targets whose mailbox may have a command since the engine last looked."""

    def __init__(self, r: Any, signer: Signer, settings: DispatchSettings):
        super().__init__(r, signer, settings)
        self.made: list[Made] = []
        self.clock = 0.0
        # Each record's playbook, by id.
        self.playbook_of: dict[str, str] = {}
        self.sent: set[keys.Target] = set()

    def execute(self, decisions: list[Any], now: float | None = None) -> list[Outcome]:
        return self._note(super().execute(decisions, now))

    def submit(self, news: list[NewRecord]) -> list[Outcome]:
        return self._note(super().submit(news))

    def _note(self, outcomes: list[Outcome]) -> list[Outcome]:
        for o in outcomes:
            if o.new and o.record_id and o.record_id not in self.playbook_of:
                self.playbook_of[o.record_id] = o.playbook
                self.made.append(Made(o.record_id, o, self.clock))
                if o.status not in QUIET:
                    self.sent.add(keys.target_of_record(o.record_id))
        return outcomes


class _NoSignals(Detections):
    """The engine's targets send no training signals (no step to stall) and detect nothing in their loops, so
    no hang or detection can be found: the reads that look for them are left out."""

    def scan_hangs(self, now: float | None = None, force: bool = False) -> list[Outcome]:
        return []

    def waiting(self, targets: Sequence[keys.Target]) -> list[keys.Target]:
        return []


class Quiet(Notifier):
    """Notifications stay in the engine (`sent`): a test or a replay never posts to a playbook's `notify` URL."""

    def __init__(self) -> None:
        super().__init__(None)
        self.sent: list[Notice] = []

    def send(self, url: str, notice: Notice) -> bool:
        self.sent.append(notice)
        return True


class _Passes(Reconciler):
    """The service's reconciler; its passes leave out the history's index and retention, which serve people's
    listings (the engine reads its records by id) and cost a dozen round trips a pass. With `followed`, records
    of other playbooks are not followed up (a replay, which reports what DECIDE decided: a follow-up changes a
    later decision only through a ladder's next stage or a breaker's place, so only playbooks with `escalate` or
    `max_active` need theirs)."""

    followed: frozenset[str] | None = None
    playbook_of: dict[str, str] = {}  # each record's playbook, as the engine's Dispatcher noted it
    # Follow-ups run in full (they may send a command: conditions, a stage, a checkpoint), since last read.
    ran = 0

    def _retention(self, now: float) -> int:
        return 0

    def _check_epoch(self) -> bool:
        return False  # the scratch Redis is the engine's own: it never comes back empty mid-run

    def _live(self, now: float) -> None:
        # Liveness follows the virtual clock, which the engine keeps (Engine._keep_live): only the breakers'
        # leases are renewed here.
        self.dispatcher.breaker.renew(list(self.playbooks.values()), now, self._still_open)

    def _goodput(self, now: float) -> None:
        return None  # the engine's targets keep no goodput figures

    def _follow(self, target: keys.Target, rid: str, now: float, view: Any) -> None:
        if self.followed is not None and (self.playbook_of.get(rid) or _playbook(self.r, rid)) not in self.followed:
            self.followup._stop(target, rid)
            return
        self.ran += 1
        super()._follow(target, rid, now, view)


class Engine:
    """One run of the service's decisions: targets, playbooks, a clock from `start`; see the module's doc."""

    def __init__(self, r: Any, playbooks: Sequence[Playbook], targets: Sequence[Live], start: float,
                 answer: Answer = Answer.APPLIED, conditions: Prometheus | None = None,
                 followed: frozenset[str] | None = None):
        self.r = r
        self.playbooks = list(playbooks)
        self.by_name = {p.name: p for p in self.playbooks}
        self.answer = answer
        self.now = start
        signer = Signer.from_secret(secrets.token_hex(32))
        self.verifier = Verifier.from_texts([signer.public])
        self.dispatcher = _Recording(r, signer, DispatchSettings())
        # No worker of the engine dies between a breaker's claim and its record, and passes come only when
        # something is due (hours apart on the virtual clock): a claim holds until a pass releases it.
        self.dispatcher.breaker.lease = VIRTUAL_LEASE
        self.dispatcher.clock = start
        settings = ReconcilerSettings()
        self.reconciler = _Passes(r, self.dispatcher, self.playbooks, settings, prometheus=conditions,
                                  detections=_NoSignals(r, self.dispatcher, self.playbooks,
                                                        hang_after=settings.hang_after))
        self.reconciler.followed = followed
        self.reconciler.playbook_of = self.dispatcher.playbook_of
        self.notices = Quiet()
        self.reconciler.followup.notifier = self.notices
        self.reconciler.mark_epoch()
        load_scripts(r)
        self.live = {t.target: t for t in targets}
        self._boxes: dict[keys.Target, Mailbox] = {}
        self._live_until = -math.inf
        self._last_pass = -1  # the instant of the reconciler's last pass (ms)
        self._first: list[Any] | None = None  # keys.DUE's earliest entry, while nothing has been written since
        # Fingerprint -> start of each alert firing now (Alertmanager's episodes).
        self.firing: dict[str, float] = {}
        pipe = r.pipeline(transaction=False)
        for t, live in self.live.items():
            self._box(t).heartbeat(live.info(), REAL_TTL, now=start, pipe=pipe)
        if self.live:
            pipe.zadd(keys.TARGETS, {t.label: start for t in self.live})  # known to the service, as if announced
        pipe.execute()
        self._keep_live()

    def close(self) -> None:
        return None

    @property
    def made(self) -> list[Made]:
        return self.dispatcher.made

    # -- the clock
    def _at(self, t: float) -> None:
        """Move the clock to t (never back), keeping every target live."""
        if t > self.now:
            self.now = t
        self.dispatcher.clock = self.now
        if self.now + LIVE_WINDOW >= self._live_until:
            self._keep_live()

    def _keep_live(self) -> None:
        """Every target counts as live until KEEP_LIVE from now (keys.live, one write per kind)."""
        self._live_until = self.now + KEEP_LIVE
        by_kind: dict[str, dict[str, int]] = {}
        for t in self.live:
            by_kind.setdefault(t.kind, {})[t.label] = ms(self._live_until)
        pipe = self.r.pipeline(transaction=False)
        for kind, members in by_kind.items():
            pipe.zadd(keys.live(kind), members)
        pipe.execute()

    def _box(self, t: keys.Target) -> Mailbox:
        box = self._boxes.get(t)
        if box is None:
            box = self._boxes[t] = Mailbox(self.r, t, self.verifier)
        return box

    def advance(self, until: float, inclusive: bool = True) -> None:
        """Run the reconciler at every instant something falls due up to `until` (or only before it), then
        stop the clock there. Passes are a millisecond apart at least, as the service's are apart in time: what
        a pass leaves due at its own instant (a hold at its deadline, which expires after it) waits for the
        next one. What falls due at the instant of a notification or a decision is run after it, so that one
        pass takes both (the service's passes come every second, in no order with the webhook)."""
        end = ms(until) - (0 if inclusive else 1)
        stuck = 0
        while True:
            # The earliest due time as the last look found it, when nothing was written since.
            first = self._first if self._first is not None else self.r.zrange(keys.DUE, 0, 0, withscores=True)
            self._first = first
            if not first:
                break
            due = int(first[0][1])
            at = max(due, ms(self.now), self._last_pass + 1)
            if at > end:
                break
            self._first = None
            stuck = stuck + 1 if due <= self._last_pass else 0
            if stuck > MAX_PASSES:
                raise EngineError(f"the reconciler kept finding {first[0][0]} due, {MAX_PASSES} passes in a row")
            self._last_pass = at
            self._at(instant(at))
            report = self.reconciler.tick(self.now)
            # Commands go out from a follow-up (conditions, stages, checkpoints), an on_resolved, or a visit that
            # offers a claim again (never here: a claim is acknowledged when it is made).
            if self.reconciler.ran or report.resolved:
                self.reconciler.ran = 0
                self._deliver(everywhere=True)
        self._at(until)

    # -- what happens
    def alert(self, labels: Mapping[str, str], firing: bool) -> dict[str, Any]:
        """An alert as Alertmanager's notification carries it now: firing since the start of its episode (now
        for a new one; a resend keeps it), or resolved now."""
        fp = fingerprint(labels)
        began = self.firing.setdefault(fp, self.now) if firing else self.firing.pop(fp, self.now)
        return {"status": "firing" if firing else "resolved", "labels": dict(labels), "annotations": {},
                "startsAt": rfc3339(began), "endsAt": NOT_ENDED if firing else rfc3339(self.now),
                "generatorURL": "", "fingerprint": fp}

    def notify(self, at: float, firing: Sequence[Mapping[str, str]] = (),
               resolved: Sequence[Mapping[str, str]] = ()) -> list[Outcome]:
        """One notification at `at`, decided as the webhook decides it (parse, plan, Dispatcher.execute)."""
        self.advance(at, inclusive=False)
        alerts = [self.alert(x, True) for x in firing] + [self.alert(x, False) for x in resolved]
        group = parse_group({"version": "4", "receiver": "trainmedic", "status": "firing" if firing else "resolved",
                             "alerts": alerts})
        outcomes = self.dispatcher.execute(plan(group, self.playbooks), self.now)
        self._first = None
        self._settle(any(o.status not in QUIET for o in outcomes))
        return outcomes

    def decide_held(self, at: float, playbook: str, verb: str) -> tuple[str, str] | None:
        """A person approves or rejects the newest record of `playbook` held for approval at `at`: (its id,
        the answer), or None when none is held."""
        self.advance(at, inclusive=False)
        pb = self.by_name[playbook]
        for m in reversed(self.made):
            if (m.outcome.playbook == playbook
                    and records.field_of(self.r, m.record_id, "status") == RecordStatus.PENDING_APPROVAL):
                due = self.dispatcher.settings.alertmanager_poll or pb.resolve_timeout
                answer = self.dispatcher.decide_held(m.record_id, verb, PERSON, "", bool(pb.on_resolved), due,
                                                     self.now)
                self.dispatcher.sent.add(keys.target_of_record(m.record_id))
                self._first = None
                self._settle()
                return m.record_id, str(answer[0])
        return None

    def record(self, record_id: str) -> dict[str, Any] | None:
        """A record as the API shows it."""
        return records.get(self.r, record_id)

    # -- the targets' side
    def _settle(self, sent: bool = True) -> None:
        """Answer what was sent (when something may have been), and run what falls due now."""
        if sent:
            self._deliver()
        self.advance(self.now)

    def _deliver(self, everywhere: bool = False) -> None:
        """Answer every command sent since the last look, as each target's applier would at once: in the
        mailboxes of the targets of the records made (or released) since, and with `everywhere` (after a
        follow-up, which may send an earlier record's command) in every mailbox that holds an entry."""
        woken, self.dispatcher.sent = self.dispatcher.sent, set()
        if everywhere:
            targets = list(self.live)
            pipe = self.r.pipeline(transaction=False)
            for t in targets:
                pipe.xlen(keys.mailbox(t))
            woken |= {t for t, n in zip(targets, pipe.execute()) if n}
        if self.answer == Answer.NONE:
            return
        for t in sorted(woken & self.live.keys(), key=lambda t: t.label):
            self._first = None
            self._apply(t)

    def _apply(self, t: keys.Target) -> None:
        live, box = self.live[t], self._box(t)
        status = "applied" if self.answer == Answer.APPLIED else "failed"
        result = {} if status == "applied" else {"error": "The test's target answered failed."}
        acks: list[Ack] = []
        for entry in box.fetch():
            if box.claim(entry, live.identity, self.now) == "ok" and entry.command is not None:
                acks.extend(Ack(entry.command.record_id, c.index, c.action, status, result, live.identity,
                                acked_at=rfc3339(self.now)) for c in entry.command.actions)
        if acks:
            box.ack(acks, self.now)
            due_now(self.r, {t}, self.now)  # what the service's listener does when it hears the acks


def _playbook(r: Any, rid: str) -> str:
    """A record's playbook, as stored ('' when it is gone or does not read)."""
    try:
        rec = records.load(r, rid)
    except records.BadRecord:
        return ""
    return rec.playbook if rec is not None else ""
