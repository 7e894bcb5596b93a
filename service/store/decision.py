"""What a record keeps of its decision, and DECIDE's arguments for one (alert, playbook) pair.

What never changes after the decision is one compact value, the record's `d` (decided_text): the playbook, the
mode and who asked, the alert as the record keeps it, the steps and their parameters, the context, the episode's
start where the alert does not give it, the ladder's stage and parent, how long a command lives. The service
seals it (seals.py); the command an applier checks is rebuilt from it (client/wire/protocol.py
command_of_record), so it is stored once.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ...client.wire import keys
from ...client.wire.protocol import alert_second, compact_json, dumps, rfc3339
from ...client.wire.status import Mode, Requester

from ..lemons import FORGET_AFTER as INCIDENT_KEEP, WINDOW as INCIDENT_WINDOW

# Annotations are free text of any size: a record keeps up to this much of them (labels are kept whole).
ANNOTATION_VALUE_MAX = 1024
ANNOTATIONS_MAX = 4096
# Alertmanager's "not ended" time: what a stored alert leaves out (shown_alert puts it back).
NOT_ENDED = "0001-01-01T00:00:00Z"
# Commands one mailbox holds waiting at most: a new one past it is skipped / mailbox_full (never trimmed).
MAILBOX_MAX = 1000


def capped_alert(alert: dict[str, Any]) -> dict[str, Any]:
    """The alert as a record keeps it: labels whole, annotations up to a few KB, `truncated` when cut."""
    notes, used, truncated = {}, 0, False
    for k, v in (alert.get("annotations") or {}).items():
        if used >= ANNOTATIONS_MAX:
            truncated = True
            break
        room = min(ANNOTATION_VALUE_MAX, ANNOTATIONS_MAX - used)
        if len(v) > room:
            v, truncated = v[:room], True
        notes[k] = v
        used += len(k) + len(v)
    return {**alert, "annotations": notes, "truncated": truncated}


def stored_alert(alert: dict[str, Any]) -> dict[str, Any]:
    """The alert as the record keeps it: capped, and without the values shown_alert puts back (Alertmanager's
    "not ended" time, an untruncated alert's flag, a firing alert's status, the alertname label)."""
    d = capped_alert(alert)
    if d.get("ends_at") == NOT_ENDED:
        del d["ends_at"]
    if d.get("truncated") is False:
        del d["truncated"]
    if d.get("status") == "firing":
        del d["status"]
    labels = d.get("labels")
    if isinstance(labels, dict) and d.get("alertname") and labels.get("alertname") == d["alertname"]:
        d["labels"] = {k: v for k, v in labels.items() if k != "alertname"}
    return d


def shown_alert(d: Any) -> dict[str, Any]:
    """The record's alert as the API shows it, from what stored_alert kept (or a whole one)."""
    if not isinstance(d, dict):
        return {}
    d = dict(d)
    d.setdefault("ends_at", NOT_ENDED)
    d.setdefault("truncated", False)
    d.setdefault("status", "firing")
    labels = d.get("labels")
    if isinstance(labels, dict) and d.get("alertname") and "alertname" not in labels:
        d["labels"] = {"alertname": d["alertname"], **labels}
    return d


@dataclass(frozen=True)
class Step:
    """One action of a record: what the applier is asked, and how the record shows it."""

    action: str
    params: dict[str, Any]
    optional: bool = False
    when: str | None = None

    @cached_property
    def wire(self) -> list[Any]:
        """The step as `d` keeps it: [action, params] and, when set, {"o": optional, "w": when}; made once,
        since playbook steps are shared by decisions."""
        flags: dict[str, Any] = {}
        if self.optional:
            flags["o"] = True
        if self.when:
            flags["w"] = self.when
        return [self.action, self.params, flags] if flags else [self.action, self.params]

    @classmethod
    def of(cls, wire: Any) -> Step:
        """A step from `d` (ValueError for one that is not)."""
        if not isinstance(wire, list) or len(wire) < 2 or not isinstance(wire[0], str):
            raise ValueError("not a step")
        flags = wire[2] if len(wire) > 2 and isinstance(wire[2], dict) else {}
        when = flags.get("w")
        return cls(wire[0], dict(wire[1] or {}), flags.get("o") is True, when if isinstance(when, str) else None)


def state_ttl(episode_ttl: float, cooldown: float, budget_window: float) -> float:
    """How long a target's state (keys.target_state) must outlive a write of a playbook's: the longest of its
    episodes' tombstones, its cooldown and its budget's window."""
    return max(episode_ttl, cooldown, budget_window)


# Actions decided before anything is sent: (index, status, reason, message) each.
Early = tuple[tuple[int, str, str, str], ...]


def early_arg(early: Early) -> dict[str, list[str]]:
    """Early decisions as the scripts take them (a JSON object keyed by action index)."""
    return {str(i): [status, reason, message] for i, status, reason, message in early}


def send_arg(indexes: tuple[int, ...] | list[int], n: int) -> str:
    """Which actions a command sends, as its record keeps them: "" for every one, else their indexes."""
    return "" if list(indexes) == list(range(n)) else " ".join(map(str, indexes))


@dataclass(frozen=True)
class Guards:
    """What may hold a record back: the playbook's cooldown, max_runs, approval and dry run."""

    cooldown: float = 0.0
    budget: tuple[int, float] = (0, 0.0)  # max_runs: (count, window in seconds); 0 for none
    approval: bool = False
    approval_timeout: float = 3600.0
    dry_run: bool = False


@dataclass(frozen=True)
class Retention:
    """How long what DECIDE writes is kept (seconds), and how much a mailbox holds."""

    expire_after: float = 3600.0  # the command
    # Refreshed by every resend, so a long episode stays one episode; a closed one is kept this long too.
    episode_ttl: float = 2 * 86400.0
    obligation_due: float = 12 * 3600.0  # an on_resolved obligation with no resolve
    mailbox_max: int = MAILBOX_MAX


@dataclass(frozen=True)
class Ladder:
    """Where a record stands in its escalation ladder (or the node record a job's checkpoint belongs to)."""

    stage: int = 0
    parent: str = ""
    prev: str = ""  # the previous stage's record (mode stage)


@dataclass(frozen=True)
class Delivery:
    """What goes out now, and how the reconciler follows the record afterwards."""

    signature: str = ""  # the command's signature ("" when nothing goes out now)
    send: str = ""  # the actions it sends (send_arg)
    early: Early = ()
    no_live: bool = False
    # `when:` conditions first: the reconciler evaluates them and sends the command.
    defer: bool = False
    # DECIDE reads the target's heartbeat itself (no_live, or 'reach' when the command does not fit it): the
    # command was made with every step, and `need` are their actions.
    check_reach: bool = False
    need: tuple[str, ...] = ()
    # The reconciler follows the record after it is decided (outcome, ladder, silence, notifications).
    follow: bool = False
    # A new followed record needs the reconciler now (a silence, a notification, conditions to evaluate);
    # otherwise one still dispatched or held waits for its ack, expiry or approval deadline like any other.
    visit_now: bool = True
    undo: bool = False  # the playbook has on_resolved actions: a firing record leaves an obligation
    # Set for records that answer for their alert (firing and stages): they get an outcome.
    verify: float | None = None


def decided_text(playbook: str, mode: str, requested_by: str, alert: dict[str, Any], steps: tuple[Step, ...],
                 context: dict[str, Any], episode_start: str, stage: int, parent: str, expire_after: float) -> str:
    """The record's `d`: what was decided, as compact JSON (the usual values left out; record.py reads it)."""
    kept = stored_alert(alert)
    d: dict[str, Any] = {"p": playbook, "a": kept, "s": [st.wire for st in steps], "x": expire_after}
    if mode != Mode.FIRING:
        d["m"] = mode
    if requested_by != Requester.WEBHOOK:
        d["by"] = requested_by
    if context:
        d["c"] = context
    if episode_start != alert_second(str(alert.get("starts_at") or "")):
        d["st"] = episode_start
    if stage:
        d["g"] = stage
    if parent:
        d["pa"] = parent
    return compact_json(d)


@dataclass(frozen=True)
class NewRecord:
    """Everything DECIDE needs to guard, record and dispatch one (alert, playbook) pair."""

    rid: str
    target: keys.Target
    playbook: str
    mode: str
    decided: str  # the record's `d` (decided_text)
    n: int  # its steps
    alertname: str
    episode_start: str
    fingerprint: str
    now: float
    guards: Guards
    keep: Retention
    delivery: Delivery
    expires_at: float  # when its command expires
    ladder: Ladder = Ladder()
    detail: str = ""
    forced_reason: str = ""
    ends_at: str = ""
    ends_ms: int = 0
    extra: tuple[tuple[str, str], ...] = ()
    # The service's seal of (rid, decided) (seals.seal_of).
    seal: str = ""
    # Once dispatched, the record is its node's incident (lemons.counts_as_incident).
    incident: bool = False

    @property
    def state_ttl(self) -> float:
        return state_ttl(self.keep.episode_ttl, self.guards.cooldown, self.guards.budget[1])

    @property
    def later(self) -> float:
        """When a dispatched or held record is next due, unless something needs the reconciler sooner."""
        return self.now + min(self.keep.expire_after, self.guards.approval_timeout, self.keep.obligation_due)

    def keys_block(self, journal: str, metrics: str) -> tuple[list[str], list[Any]]:
        """DECIDE's eleven KEYS and its ARGV block, by position (lua/decide.lua names each)."""
        t = self.target
        now_ms = int(self.now * 1000)
        g, k, x = self.guards, self.keep, self.delivery
        block: list[Any] = [
            now_ms, self.mode, self.episode_start, self.rid, self.forced_reason,
            int(g.cooldown * 1000), g.budget[0], int(g.budget[1] * 1000), int(g.approval), int(g.dry_run),
            int(x.undo), int(k.episode_ttl * 1000), int(self.state_ttl * 1000), k.mailbox_max, x.signature,
            int(self.expires_at * 1000), int((self.now + g.approval_timeout) * 1000),
            keys.obligation_member(self.playbook, self.fingerprint), int((self.now + k.obligation_due) * 1000),
            self.n, int(x.follow), self.ends_at, self.ends_ms, dumps(early_arg(x.early)) if x.early else "",
            int(x.no_live), int(x.defer), int(x.check_reach), " ".join(x.need), t.label, int(x.visit_now),
            int(self.later * 1000), "" if x.verify is None else int(x.verify * 1000), self.fingerprint,
            self.playbook, self.alertname, x.send, rfc3339(self.now), self.decided, self.seal, t.kind,
            int(self.incident), int(INCIDENT_WINDOW * 1000), int(INCIDENT_KEEP * 1000),
        ]
        if self.detail:
            block += ("detail", self.detail)
        for kv in self.extra:
            block += kv
        ks = [keys.record(self.rid), keys.mailbox(t), keys.target_state(t),
              keys.obligation(t, self.playbook, self.fingerprint), keys.due_items(t)]
        # The ladder's previous record (mode stage), else the record again (DECIDE reads it only in a stage).
        ks.append(keys.record(self.ladder.prev) if self.ladder.prev else ks[0])
        ks += [keys.heartbeat(t), journal, metrics, keys.node_incidents(t), keys.node_incident_times(t)]
        return ks, block

