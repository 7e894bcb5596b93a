"""The record as the API shows it: frozen view dataclasses whose fields are the record's keys (README: "HTTP API",
a record), and the OpenAPI schema derived from them (schema.schema_of), so the two cannot drift apart.

StoredRecord.view() (record.py) builds a RecordView; SCHEMA is derived from the same classes. A field's metadata
holds its OpenAPI extras. Enum-typed fields hold the stored string (a member equals its value): a hash someone
rewrote is still shown as it is.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

from ...client.wire import keys
from ...client.wire.status import ActionReason, ActionStatus, Outcome, Reason, RecordStatus, Requester

from .decision import NOT_ENDED
from .schema import TIME, View, schema_of, view


@view
class AlertView(View):
    """The alert a record answers (capped_alert: annotations cut to a few KB)."""

    alertname: str
    status: Literal["firing", "resolved"]
    fingerprint: str
    starts_at: str
    ends_at: str
    labels: dict[str, str]
    annotations: dict[str, str]
    generator_url: str
    truncated: bool = dataclasses.field(metadata={"description": "true when annotations were cut to a few KB"})

    @classmethod
    def of(cls, alert: Mapping[str, Any]) -> AlertView:
        """The view of an alert as shown_alert gives it (a record without one shows empty values)."""
        get = alert.get
        return cls(alertname=get("alertname", ""), status=get("status", "firing"),
                   fingerprint=get("fingerprint", ""), starts_at=get("starts_at", ""),
                   ends_at=get("ends_at", NOT_ENDED), labels=get("labels", {}), annotations=get("annotations", {}),
                   generator_url=get("generator_url", ""), truncated=get("truncated", False))


@view
class ActionView(View):
    """One action of a record: what was asked, and how its applier answered."""

    action: str = dataclasses.field(metadata={"example": "scale_lr"})
    params: dict[str, Any]
    status: ActionStatus
    reason: str | None = dataclasses.field(
        metadata={"description": f"{', '.join(ActionReason)}, or the applier's own (no_cuda, ...)"})
    result: dict[str, Any] | None = dataclasses.field(
        metadata={"description": 'What the applier reported, e.g. {"old_lr": [..], "new_lr": [..], "step": 1234}'})
    acked_at: str | None = dataclasses.field(metadata=TIME)
    acked_by: str | None = dataclasses.field(metadata={"description": "host:pid[:rank]"})
    reapplied: list[dict[str, Any]] = dataclasses.field(
        metadata={"description": "Each time a resumed or rolled-back job applied it again"})
    optional: bool | None = None
    when: str | None = None


@view
class OutcomeView(View):
    """Whether the remediation worked, and when its alert resolved."""

    status: Outcome
    resolved_at: str | None = dataclasses.field(metadata=TIME)
    time_to_resolve_s: float | None


@view
class Escalation(View):
    """The record's place in its escalation ladder."""

    stage: int = dataclasses.field(metadata={"minimum": 0})
    parent: str | None
    next: str | None


@view
class RecordView(View):
    """A remediation record, as GET /remediations/{id} and the history show it (README: HTTP API, a record)."""

    id: str = dataclasses.field(metadata={"pattern": keys.RECORD_ID_RE.pattern.replace("\\Z", "$")})
    created_at: str = dataclasses.field(metadata=TIME)
    playbook: str
    status: RecordStatus
    reason: str | None = dataclasses.field(
        metadata={"description": f"Why it was skipped or expired: {', '.join(Reason)}, ..."})
    alert: AlertView
    target: keys.Target
    actions: list[ActionView]
    # A person acting with their own operator token is recorded as operator:NAME.
    requested_by: str | None = dataclasses.field(
        metadata={"pattern": f"^({'|'.join(Requester)}|operator:[A-Za-z0-9_.@-]{{1,64}})$"})
    approved_by: str | None
    approved_at: str | None = dataclasses.field(metadata=TIME)
    rejected_by: str | None
    rejected_at: str | None = dataclasses.field(metadata=TIME)
    approval_comment: str | None
    outcome: OutcomeView | None
    escalation: Escalation
    silence_id: str | None
    silence_error: str | None
    detail: str | None = None
    on_resolved: bool | None = dataclasses.field(
        default=None, metadata={"description": "true for the on_resolved actions of a resolved alert"})
    approval_expires_at: str | None = dataclasses.field(default=None, metadata=TIME)
    expires_at: str | None = dataclasses.field(default=None, metadata=TIME)


# The record's components, by the names the OpenAPI document gives them; a Target is described beside the
# operations (service/web/openapi.py), which show targets elsewhere too.
COMPONENTS: dict[type, str] = {ActionView: "RecordAction", RecordView: "Record", AlertView: "RecordAlert"}
SCHEMA: dict[str, dict[str, Any]] = {
    name: schema_of(cls, {**COMPONENTS, keys.Target: "Target"}) for cls, name in COMPONENTS.items()}
