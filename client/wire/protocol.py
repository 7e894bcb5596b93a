"""The wire format between the service and appliers (training client, node agent): Command and Ack."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

VERSION = 1

# Action statuses an applier may report; "pending" and "delivered" are the service's own.
ACK_STATUSES = ("applied", "failed", "unsupported", "expired", "skipped")


def rfc3339(ts: float | None = None) -> str:
    """UTC timestamp in RFC 3339 with milliseconds."""
    dt = datetime.fromtimestamp(time.time() if ts is None else ts, tz=timezone.utc)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{dt.microsecond // 1000:03d}Z"


class ProtocolError(ValueError):
    """A mailbox entry that is not a command this version understands."""


@dataclass(frozen=True)
class ActionCall:
    """One action of a command, at its position in the record."""

    index: int
    action: str
    params: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Command:
    """What the service appends to a target's mailbox: the actions of one remediation."""

    record_id: str
    kind: str
    target: str
    actions: tuple[ActionCall, ...]
    issued_at: float
    expires_at: float
    # Validated alert labels an action needs besides its params (e.g. gpu_id for power_limit).
    context: dict = field(default_factory=dict)
    # The alert's fingerprint, so the applier's log lines name the alert as the service's do ("" if none).
    fingerprint: str = ""
    v: int = VERSION

    def expired(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) > self.expires_at

    def to_json(self) -> str:
        return json.dumps({
            "v": self.v, "record_id": self.record_id, "kind": self.kind, "target": self.target,
            "actions": [{"index": a.index, "action": a.action, "params": a.params} for a in self.actions],
            "issued_at": self.issued_at, "expires_at": self.expires_at, "context": self.context,
            "fingerprint": self.fingerprint,
        }, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> "Command":
        try:
            d = json.loads(text)
            if d.get("v") != VERSION:
                raise ProtocolError(f"command version {d.get('v')!r} is not {VERSION}")
            actions = tuple(
                ActionCall(int(a["index"]), str(a["action"]), dict(a.get("params") or {}))
                for a in d["actions"]
            )
            return cls(record_id=str(d["record_id"]), kind=str(d["kind"]), target=str(d["target"]),
                       actions=actions, issued_at=float(d["issued_at"]),
                       expires_at=float(d["expires_at"]), context=dict(d.get("context") or {}),
                       fingerprint=str(d.get("fingerprint") or "")[:64])
        except ProtocolError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ProtocolError(f"malformed command: {exc}") from None


@dataclass(frozen=True)
class Ack:
    """An applier's answer for one action of a command."""

    record_id: str
    index: int
    action: str
    status: str
    result: dict
    acked_by: str
    acked_at: str = field(default_factory=rfc3339)
