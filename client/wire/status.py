"""The statuses, outcomes and reasons a record holds, as StrEnums: what appliers, scripts and the service share.

A member equals its string, so what Redis and JSON hold is the plain value, and code compares with members
instead of string literals. The Lua scripts write the same values (lua/common.lua).
"""
from __future__ import annotations

from enum import StrEnum


class RecordStatus(StrEnum):
    """A record's status (README: "HTTP API", a record)."""

    PENDING_APPROVAL = "pending_approval"
    DISPATCHED = "dispatched"
    APPLIED = "applied"
    PARTIALLY_APPLIED = "partially_applied"
    FAILED = "failed"
    LOST = "lost"
    SKIPPED = "skipped"
    DRY_RUN = "dry_run"
    EXPIRED = "expired"

    @property
    def final(self) -> bool:
        """Whether a record in this status changes no more (its outcome still may)."""
        return self not in (RecordStatus.PENDING_APPROVAL, RecordStatus.DISPATCHED)


class ActionStatus(StrEnum):
    """An action's status within its record: open (pending, delivered), an ack's status, or lost."""

    PENDING = "pending"
    DELIVERED = "delivered"
    APPLIED = "applied"
    FAILED = "failed"
    UNSUPPORTED = "unsupported"
    EXPIRED = "expired"
    SKIPPED = "skipped"
    LOST = "lost"

    @property
    def open(self) -> bool:
        """Whether the action still waits for its applier."""
        return self in (ActionStatus.PENDING, ActionStatus.DELIVERED)


# A record keeps its actions' statuses as one character each (its field `as`; lua/common.lua CODE).
ACTION_CODES: dict[ActionStatus, str] = {
    ActionStatus.PENDING: "P", ActionStatus.DELIVERED: "D", ActionStatus.APPLIED: "A", ActionStatus.FAILED: "F",
    ActionStatus.UNSUPPORTED: "U", ActionStatus.EXPIRED: "E", ActionStatus.SKIPPED: "S", ActionStatus.LOST: "L"}
CODE_STATUS: dict[str, ActionStatus] = {code: status for status, code in ACTION_CODES.items()}


class Outcome(StrEnum):
    """Whether a record's remediation worked: decided when its alert resolves or its verify time passes."""

    PENDING = "pending"
    EFFECTIVE = "effective"
    INEFFECTIVE = "ineffective"
    UNKNOWN = "unknown"


class Reason(StrEnum):
    """Why a record was skipped or expired, or what it says while dispatched (no_live_target)."""

    COOLDOWN = "cooldown"
    BUDGET_EXHAUSTED = "budget_exhausted"
    NO_ACTIONS = "no_actions"
    NO_TARGET = "no_target"
    BAD_LABEL = "bad_label"
    REJECTED = "rejected"
    TAMPERED = "tampered"
    BREAKER_OPEN = "breaker_open"
    MAILBOX_FULL = "mailbox_full"
    NO_LIVE_TARGET = "no_live_target"
    APPROVAL_EXPIRED = "approval_expired"
    RESOLVED_BEFORE_APPROVAL = "resolved_before_approval"
    RESOLVED_NOT_NOTIFIED = "resolved_not_notified"


class ActionReason(StrEnum):
    """Why an action ended as it did, where the service or a script decided it (an applier may give its own,
    such as no_cuda)."""

    UNSUPPORTED = "unsupported"
    TARGET_CANNOT = "target_cannot"
    CONDITION_FALSE = "condition_false"
    CONDITION_UNKNOWN = "condition_unknown"
    EXPIRED = "expired"
    LOST = "lost"
    TAMPERED = "tampered"
    REJECTED = "rejected"
    APPROVAL_EXPIRED = "approval_expired"
    RESOLVED_BEFORE_APPROVAL = "resolved_before_approval"


class Mode(StrEnum):
    """What a record answers: a firing alert, a resolve (on_resolved; timeout when none came), a person, or a
    stage of an escalation ladder."""

    FIRING = "firing"
    RESOLVED = "resolved"
    TIMEOUT = "timeout"
    MANUAL = "manual"
    STAGE = "stage"


class Requester(StrEnum):
    """Who asked for a record (a person acting with their own token is operator:NAME)."""

    WEBHOOK = "webhook"
    OPERATOR = "operator"
    RECONCILER = "reconciler"
    DETECTOR = "detector"
    RESYNC = "resync"


def values(enum: type[StrEnum]) -> list[str]:
    """An enum's values, in order (the OpenAPI schema's enums)."""
    return [m.value for m in enum]
