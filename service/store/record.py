"""Reading a record: its hash parsed once into a typed StoredRecord (the only reader of a record's fields).

The scripts of client/wire/lua write records (lua/common.lua says what each field holds); everything in the
service reads them through StoredRecord: the history, the pages, the API, the reconciler. A record an earlier
version made (its fields spread over ~40 hash fields) is read into the same type. A hash that does not parse
as a record (someone wrote to it) is a BadRecord: callers skip it and count a repair, never a 500.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Mapping

from ...client.wire import keys
from ...client.wire.protocol import alert_second, fence, rfc3339
from ...client.wire.status import CODE_STATUS, ActionStatus, Mode, Outcome, RecordStatus, Requester

from .decision import Step, shown_alert
from .seals import earlier_seal_text, seal_text
from .views import ActionView, AlertView, Escalation, OutcomeView, RecordView

_CROCKFORD = {c: i for i, c in enumerate("0123456789ABCDEFGHJKMNPQRSTVWXYZ")}
# An id's head holds microseconds in its top 55 bits of 130 (the rest is randomness).
_RANDOM_BITS = 75


class BadRecord(ValueError):
    """A record's hash that does not read as one (fields of the wrong shape)."""


def created_us(record_id: str) -> int:
    """When a record was made (µs since the epoch), from its id's head."""
    n = 0
    for c in record_id[:26]:
        n = n * 32 + _CROCKFORD[c]
    return n >> _RANDOM_BITS


@dataclass(frozen=True)
class ActionState:
    """One action of a record as it stands: the step, and how its applier (or the service) answered."""

    step: Step
    status: ActionStatus
    reason: str | None = None
    result: dict[str, Any] | None = None
    acked_at: str | None = None
    acked_by: str | None = None
    reapplied: tuple[dict[str, Any], ...] = ()

    def view(self) -> ActionView:
        st = self.step
        return ActionView(action=st.action, params=st.params, status=self.status, reason=self.reason,
                          result=self.result, acked_at=self.acked_at, acked_by=self.acked_by,
                          reapplied=list(self.reapplied), optional=True if st.optional else None,
                          when=st.when or None)


def _number(text: str) -> float | str:
    """A JSON number, or its literal when it overflows to infinity (the views are strict JSON)."""
    value = float(text)
    return value if math.isfinite(value) else text


def _json(text: Any, kind: type, what: str) -> Any:
    """JSON text that must hold a `kind` (BadRecord otherwise); None for none. NaN and Infinity, which only a
    record written by hand can hold, are read as their literals."""
    if text is None or text == "":
        return None
    try:
        value = json.loads(text, parse_constant=str, parse_float=_number)
    except ValueError:
        raise BadRecord(f"its {what} is not JSON") from None
    if not isinstance(value, kind):
        raise BadRecord(f"its {what} is not a JSON {kind.__name__}")
    return value


def _int(text: Any, what: str) -> int | None:
    if text is None or text == "":
        return None
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise BadRecord(f"its {what} is not a number") from None
    if not math.isfinite(value):
        raise BadRecord(f"its {what} is not a finite number")
    return int(value)


def _str(text: Any) -> str | None:
    return str(text) if text else None


def _status(text: Any) -> RecordStatus:
    try:
        return RecordStatus(text)
    except ValueError:
        raise BadRecord(f"its status {str(text)[:40]!r} is not a record's") from None


def _action_status(text: Any) -> ActionStatus:
    try:
        return ActionStatus(text)
    except ValueError:
        raise BadRecord(f"an action's status {str(text)[:40]!r} is not one") from None


def _outcome(text: Any) -> OutcomeView | None:
    o = _json(text, dict, "outcome")
    if o is None:
        return None
    try:
        status = Outcome(o.get("status"))
    except ValueError:
        raise BadRecord("its outcome is not one") from None
    ttr = o.get("time_to_resolve_s")
    if ttr is not None and not (isinstance(ttr, (int, float)) and math.isfinite(ttr)):
        raise BadRecord("its time to resolve is not a finite number")
    return OutcomeView(status=status, resolved_at=_str(o.get("resolved_at")), time_to_resolve_s=ttr)


@dataclass(frozen=True)
class StoredRecord:
    """A record as Redis holds it, parsed once: what was decided, and how it stands now."""

    id: str
    target: keys.Target
    created_ms: int
    playbook: str
    mode: str
    requested_by: str
    status: RecordStatus
    reason: str | None
    detail: str | None
    alert: AlertView
    actions: tuple[ActionState, ...]
    context: dict[str, Any]
    start: str  # the alert episode's start (to the second)
    stage: int
    parent: str | None
    next: str | None
    follow: bool
    verify_ms: int | None
    expire_after: float
    expires_ms: int | None
    approve_by_ms: int | None
    dispatched_ms: int
    settled_ms: int | None
    waiting_conditions: bool
    outcome: OutcomeView | None
    approved_by: str | None = None
    approved_at: str | None = None
    rejected_by: str | None = None
    rejected_at: str | None = None
    approval_comment: str | None = None
    silence_id: str | None = None
    silence_error: str | None = None
    silence_seal: str | None = None
    ladder_end: str | None = None
    breaker_opened: bool = False
    checkpoint_plan: str | None = None
    # What was decided, its `d` byte for byte (what a command is signed over); "" for an earlier version's.
    decided: str = ""
    # What the seal covers (seals.py): the record's `d`, or for an earlier version's record its fields.
    _sealed: bytes = field(default=b"", repr=False)
    _seal: str | None = field(default=None, repr=False)

    @property
    def steps(self) -> tuple[Step, ...]:
        return tuple(a.step for a in self.actions)

    @property
    def n(self) -> int:
        return len(self.actions)

    @property
    def created_at(self) -> str:
        return rfc3339(self.created_ms / 1000)

    @property
    def fingerprint(self) -> str:
        return self.alert.fingerprint

    @property
    def fence(self) -> str:
        """What the record's applier fences on besides its id (protocol.fence)."""
        return fence(self.alert.fingerprint, self.start, self.playbook, self.stage, self.mode)

    @property
    def alert_dict(self) -> dict[str, Any]:
        """The record's alert as the API shows it."""
        return self.alert.as_dict()

    def intact(self, signer: Any) -> bool:
        """Whether the record still holds what the service decided (its seal matches; Signer.sealed)."""
        return bool(self._sealed) and signer.sealed(self._sealed, self._seal)

    def view(self) -> RecordView:
        """The record as the API shows it."""
        status = self.status
        return RecordView(
            id=self.id, created_at=self.created_at, playbook=self.playbook, status=status, reason=self.reason,
            alert=self.alert, target=self.target, actions=[a.view() for a in self.actions],
            requested_by=self.requested_by or None, approved_by=self.approved_by, approved_at=self.approved_at,
            rejected_by=self.rejected_by, rejected_at=self.rejected_at, approval_comment=self.approval_comment,
            outcome=self.outcome, escalation=Escalation(stage=self.stage, parent=self.parent, next=self.next),
            silence_id=self.silence_id, silence_error=self.silence_error, detail=self.detail,
            on_resolved=True if self.mode in (Mode.RESOLVED, Mode.TIMEOUT) else None,
            approval_expires_at=rfc3339(self.approve_by_ms / 1000)
            if self.approve_by_ms and status == RecordStatus.PENDING_APPROVAL else None,
            expires_at=rfc3339(self.expires_ms / 1000)
            if self.expires_ms and status == RecordStatus.DISPATCHED else None)

    def as_dict(self) -> dict[str, Any]:
        """The record as the API shows it (RecordView's JSON)."""
        return self.view().as_dict()

    @classmethod
    def from_hash(cls, record_id: str, h: Mapping[str, Any]) -> StoredRecord:
        """The record of a non-empty hash (HGETALL's answer) under this id; BadRecord if it does not read as one."""
        try:
            target = keys.target_of_record(record_id)
            if "d" in h:
                return _of_hash(cls, record_id, target, h)
            return _of_earlier_hash(cls, record_id, target, h)
        except BadRecord:
            raise
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            raise BadRecord(f"it does not read as a record ({type(exc).__name__}: {exc})") from None


def _marks(h: Mapping[str, Any]) -> dict[str, Any]:
    """What people and the reconciler added to a record after its decision (both layouts share these)."""
    return dict(approved_by=_str(h.get("approved_by")), approved_at=_str(h.get("approved_at")),
                rejected_by=_str(h.get("rejected_by")), rejected_at=_str(h.get("rejected_at")),
                approval_comment=_str(h.get("approval_comment")), silence_id=_str(h.get("silence_id")),
                silence_error=_str(h.get("silence_error")), silence_seal=_str(h.get("silence_seal")),
                ladder_end=_str(h.get("ladder_end")), breaker_opened=bool(h.get("breaker_opened")),
                checkpoint_plan=_str(h.get("ckpt")), _seal=_str(h.get("seal")))


def _of_hash(cls: type[StoredRecord], rid: str, target: keys.Target, h: Mapping[str, Any]) -> StoredRecord:
    """A record as lua/decide.lua writes it: `d`, and what changed since beside it."""
    decided = str(h["d"])
    d = _json(decided, dict, "decision")
    alert = shown_alert(d.get("a"))
    steps = tuple(Step.of(w) for w in d.get("s") or ())
    status = _status(h.get("status"))
    codes = h.get("as")
    actions = []
    for i, st in enumerate(steps):
        code = codes[i] if isinstance(codes, str) and i < len(codes) else "S"
        answer = _json(h.get(f"r:{i}"), dict, f"action {i}'s answer") or {}
        result = answer.get("result")
        actions.append(ActionState(
            step=st, status=CODE_STATUS.get(code, ActionStatus.SKIPPED), reason=_str(answer.get("reason")),
            result=result if isinstance(result, dict) else None, acked_at=_str(answer.get("at")),
            acked_by=_str(answer.get("by")), reapplied=tuple(_json(h.get(f"re:{i}"), list, "reapplied") or ())))
    created_ms = created_us(rid) // 1000
    context = d.get("c") or {}
    if not isinstance(context, dict):
        raise BadRecord("its context is not a JSON object")
    return cls(
        id=rid, target=target, created_ms=created_ms, playbook=str(d.get("p") or ""),
        mode=str(d.get("m") or Mode.FIRING), requested_by=str(d.get("by") or Requester.WEBHOOK), status=status,
        reason=_str(h.get("reason")), detail=_str(h.get("detail")), alert=AlertView.of(alert),
        actions=tuple(actions), context=context,
        start=str(d.get("st") or alert_second(str(alert.get("starts_at") or ""))), stage=int(d.get("g") or 0),
        parent=_str(d.get("pa")), next=_str(h.get("next")), follow=h.get("f") == "1",
        verify_ms=_int(h.get("v"), "verify time"), expire_after=float(d.get("x") or 3600),
        expires_ms=_int(h.get("exp"), "expiry"), approve_by_ms=_int(h.get("ab"), "approval deadline"),
        dispatched_ms=_int(h.get("at"), "dispatch time") or created_ms,
        settled_ms=_int(h.get("settled_ms"), "settle time"), waiting_conditions=h.get("conds") == "1",
        outcome=_outcome(h.get("outcome")), decided=decided, _sealed=seal_text(rid, decided), **_marks(h))


def _of_earlier_hash(cls: type[StoredRecord], rid: str, target: keys.Target,
                     h: Mapping[str, Any]) -> StoredRecord:
    """A record as an earlier version wrote it: each decided value and each action's state in fields of its own."""
    alert_text = h.get("alert")
    alert = shown_alert(_json(alert_text, dict, "alert")) if alert_text else {}
    status = _status(h.get("status"))
    usual = ActionStatus.SKIPPED if status == RecordStatus.SKIPPED else ActionStatus.PENDING
    actions = []
    for i in range(_int(h.get("n"), "number of actions") or 0):
        spec = _json(h.get(f"a:{i}:spec"), dict, f"action {i}") or {}
        p = f"a:{i}:"
        result = _json(h.get(p + "result"), dict, f"action {i}'s result")
        actions.append(ActionState(
            step=Step(str(spec.get("action") or ""), dict(spec.get("params") or {}), spec.get("optional") is True,
                      spec.get("when") or None),
            status=_action_status(h.get(p + "status") or usual), reason=_str(h.get(p + "reason")), result=result,
            acked_at=_str(h.get(p + "acked_at")), acked_by=_str(h.get(p + "acked_by")),
            reapplied=tuple(_json(h.get(p + "reapplied"), list, "reapplied") or ())))
    created_ms = _int(h.get("created_ms"), "creation time") or created_us(rid) // 1000
    return cls(
        id=rid, target=target, created_ms=created_ms, playbook=str(h.get("playbook") or ""),
        mode=str(h.get("mode") or Mode.FIRING), requested_by=str(h.get("requested_by") or Requester.WEBHOOK),
        status=status, reason=_str(h.get("reason")), detail=_str(h.get("detail")), alert=AlertView.of(alert),
        actions=tuple(actions), context=_json(h.get("context"), dict, "context") or {},
        start=str(h.get("start") or alert_second(str(alert.get("starts_at") or ""))),
        stage=_int(h.get("stage"), "stage") or 0, parent=_str(h.get("parent")), next=_str(h.get("next")),
        follow=h.get("follow") == "1", verify_ms=_int(h.get("verify_ms"), "verify time"),
        expire_after=float(h.get("expire_after") or 3600), expires_ms=_int(h.get("expires_ms"), "expiry"),
        approve_by_ms=_int(h.get("approve_by"), "approval deadline"),
        dispatched_ms=_int(h.get("dispatched_ms"), "dispatch time") or created_ms,
        settled_ms=_int(h.get("settled_ms"), "settle time"), waiting_conditions=h.get("conds") == "1",
        outcome=_outcome(h.get("outcome")), _sealed=earlier_seal_text(rid, h), **_marks(h))


def load(r: Any, record_id: str) -> StoredRecord | None:
    """One stored record, parsed, or None when it is gone (or its id is not one); BadRecord if it does not read."""
    try:
        key = keys.record(record_id)
    except ValueError:
        return None
    h = r.hgetall(key)
    return StoredRecord.from_hash(record_id, h) if h else None


def get(r: Any, record_id: str) -> dict[str, Any] | None:
    """One record as the API shows it, or None (also for a malformed id, or a hash that is not a record)."""
    try:
        rec = load(r, record_id)
    except BadRecord:
        return None
    return rec.as_dict() if rec is not None else None


# -- the service's own bookkeeping on a record ------------------------------------------------------------
# Besides what the Lua scripts write, the reconciler keeps marks on the record: `f` (it still follows the
# record), `notified:<event>`, `counted:<outcome>`, `ladder_end`, and `silence_claim` / `silence_id` /
# `silence_seal` (seals.silence_text's seal: only the silence it made is ever expired) / `silence_error`.
# Marks are set with HSETNX so that racing replicas do each thing once.

def field_of(r: Any, record_id: str, name: str) -> str | None:
    """One stored field of the record."""
    value = r.hget(keys.record(record_id), name)
    return None if value is None else str(value)


def mark_once(r: Any, record_id: str, name: str, value: str = "1") -> bool:
    """Set a mark unless it is set already: True for the one caller that set it."""
    return bool(r.hsetnx(keys.record(record_id), name, value))


def set_marks(r: Any, record_id: str, **marks: str) -> None:
    """Set (overwrite) bookkeeping marks on the record."""
    r.hset(keys.record(record_id), mapping=marks)


def stop_following(r: Any, record_id: str) -> None:
    """The reconciler no longer follows the record (both layouts' marks)."""
    r.hdel(keys.record(record_id), "f", "follow")
