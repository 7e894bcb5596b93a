"""The wire format between the service and the appliers (training client, node agent): Command and Ack."""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from datetime import datetime, UTC
from typing import Any
from collections.abc import Callable

from . import keys

VERSION = 2

# Action statuses an applier may report; "pending", "delivered" and "lost" are the service's own.
ACK_STATUSES = ("applied", "failed", "unsupported", "expired", "skipped")
# A target is live while its heartbeat is this recent (GET /targets, metrics, the reconciler).
LIVE_WINDOW = 60.0
HEARTBEAT_TTL = 30.0
# A job's training signals outlive its last heartbeat this long (its series leave /metrics then).
SIGNALS_TTL = 120.0
# What an applier tells the service on its own channel (keys.up_channel): it wrote a detection (DETECTED),
# its acks settled a record (ACKS), or it is alive (BEAT: its first heartbeat, and then now and then, so that a
# service that restarted learns of it).
DETECTED = "detected"
ACKS = "acks"
BEAT = "beat"
# The fields of a signals line, in order ("-" where unknown).
SIGNAL_FIELDS = ("step", "step_since", "loss", "learning_rate", "samples_per_second", "grad_norm")
# Whole numbers beyond this are no longer exact as the float a scraper reads them into.
_INT_LIMIT = 1 << 53


def signals_line(signals: dict[str, Any]) -> str:
    """A heartbeat's signals as one short line: step, since when (ms), loss, LR, samples/s, grad norm."""
    # Each value is written as Prometheus's text format writes a number, so GET /metrics copies it as it is;
    # an unknown or non-finite value is "-" (the job's series of that metric is left out meanwhile).
    out = []
    for name in SIGNAL_FIELDS:
        v = signals.get(name)
        if name == "step_since" and isinstance(v, (int, float)) and math.isfinite(v):
            v = int(v * 1000)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            out.append("-")
        elif isinstance(v, int):
            out.append(repr(v) if -_INT_LIMIT < v < _INT_LIMIT else "-")
        else:
            out.append(repr(v) if math.isfinite(v) else "-")
    return " ".join(out)


def parse_signals(text: str) -> tuple[float | None, ...] | None:
    """A signals line's values (None where unknown), or None for a line that is not one."""
    parts = text.split(" ")
    if len(parts) != len(SIGNAL_FIELDS):
        return None
    try:
        return tuple(None if p == "-" else float(p) for p in parts)
    except ValueError:
        return None


# The last whole second formatted, and its text up to the fraction: most calls fall in the same second.
_last_second: tuple[int, str] = (-1, "")


def rfc3339(ts: float | None = None) -> str:
    """UTC timestamp in RFC 3339 with milliseconds."""
    global _last_second
    if ts is None:
        ts = time.time()
    if not ts >= 0:  # before 1970 (or NaN): the general path
        dt = datetime.fromtimestamp(ts, tz=UTC)
        return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{dt.microsecond // 1000:03d}Z"
    # Rounded to the microsecond as datetime.fromtimestamp rounds (half to even), then cut to milliseconds.
    frac, whole = math.modf(ts)
    us = round(frac * 1e6)
    if us >= 1_000_000:
        whole, us = whole + 1, us - 1_000_000
    second = int(whole)
    last = _last_second
    if last[0] != second:
        last = (second, datetime.fromtimestamp(second, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S."))
        _last_second = last
    return f"{last[1]}{us // 1000:03d}Z"


def parse_rfc3339(text: object) -> float | None:
    """Seconds since the epoch of an RFC 3339 time (any fraction of a second), or None for anything else."""
    if not isinstance(text, str) or not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


# One encoder for every call: json.dumps with options builds a new JSONEncoder each time.
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False, default=str)


def dumps(value: Any) -> str:
    """Compact JSON that refuses NaN and infinities (strict parsers reject them; records never hold them)."""
    return _ENCODER.encode(value)


def _compact_encoder() -> Callable[[Any], str]:
    """compact_json: orjson where it is installed (the service's extra brings it), else dumps. For text that is
    written once and parsed back, never compared with another encoding: the bytes a command is signed over,
    the alert a record keeps. Both hold only values checked finite when their playbook or request was read."""
    try:
        import orjson
    except ImportError:
        return dumps
    return lambda value: orjson.dumps(value).decode()


compact_json = _compact_encoder()


def finite(value: Any) -> Any:
    """value with every non-finite float replaced by None (for results from handlers we do not control)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def fence(fingerprint: str, start: str, playbook: str, stage: int, mode: str) -> str:
    """What an applier fences on besides the record id (Command.fence): one alert episode, playbook, stage and
    mode; a timeout undoes as a resolve does and a stage fires, and a manual command has none."""
    if mode == "manual":
        return ""
    mode = {"timeout": "resolved", "stage": "firing"}.get(mode, mode)
    return f"{fingerprint}|{start}|{playbook}|{stage}|{mode}"


def alert_second(starts_at: str) -> str:
    """An Alertmanager startsAt ("...T01:25:24.115Z") to the second, as an episode starts ("" for a time in another
    form: then the record stores its start)."""
    return starts_at[:19] + "Z" if len(starts_at) >= 20 and starts_at.endswith("Z") else ""


# What a record's command is signed over (command_message): never the bytes of anything else.
_COMMAND_DOMAIN = b"trainmedic-command-v4\n"


def command_message(record_id: str, expires_ms: int, send: str, decided: str) -> bytes:
    """The exact bytes a record's command is signed over: its id, when it expires, which actions it sends ("" for
    all, else their indexes) and what was decided (the record's `d`, byte for byte)."""
    return b"".join((_COMMAND_DOMAIN, record_id.encode(), b"\n", str(int(expires_ms)).encode(), b"\n", send.encode(),
                     b"\n", decided.encode()))


class ProtocolError(ValueError):
    """A mailbox entry that is not a command this version understands."""


@dataclass(frozen=True)
class ActionCall:
    """One action of a command, at its position in the record."""

    index: int
    action: str
    params: dict[str, Any] = field(default_factory=dict)
    # An optional step that this target cannot apply is skipped (reason unsupported), not a failure.
    optional: bool = False


@dataclass(frozen=True)
class Command:
    """What the service appends to a target's mailbox: the actions of one remediation, signed as bytes."""

    record_id: str
    kind: str
    target: str
    actions: tuple[ActionCall, ...]
    issued_at: float
    expires_at: float
    # Validated alert labels an action needs besides its params (e.g. gpu_id for power_limit).
    context: dict[str, Any] = field(default_factory=dict)
    # The alert's fingerprint, so the applier's log lines name the alert as the service's do ("" if none).
    fingerprint: str = ""
    # What the applier fences on besides the record id: "fingerprint|episode start|playbook|stage|mode",
    # so a resend that Redis turned into a new record is still not applied twice ("" for manual commands).
    fence: str = ""
    # The alert's startsAt (RFC 3339, "" if none): rollback_checkpoint restores from before it.
    starts_at: str = ""
    v: int = VERSION

    def expired(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) > self.expires_at

    def to_json(self) -> str:
        """The exact bytes the service signs (as text)."""
        return compact_json({
            "v": self.v, "record_id": self.record_id, "kind": self.kind, "target": self.target,
            "actions": [{"index": a.index, "action": a.action, "params": a.params, **({"optional": True}
                         if a.optional else {})} for a in self.actions],
            "issued_at": self.issued_at, "expires_at": self.expires_at, "context": self.context,
            "fingerprint": self.fingerprint, "fence": self.fence, "starts_at": self.starts_at,
        })

    @classmethod
    def from_json(cls, text: str | bytes) -> Command:
        try:
            # NaN and Infinity parse as 1e999 already does, so the action is refused where its params are checked
            # (failed, with a sentence) instead of the whole command being ignored and left to expire.
            d = json.loads(text, parse_constant=float)
            if d.get("v") != VERSION:
                raise ProtocolError(f"command version {d.get('v')!r} is not {VERSION}")
            actions = tuple(ActionCall(int(a["index"]), str(a["action"]), dict(a.get("params") or {}),
                                       a.get("optional") is True) for a in d["actions"])
            return cls(record_id=str(d["record_id"]), kind=str(d["kind"]), target=str(d["target"]),
                       actions=actions, issued_at=_time(d["issued_at"]), expires_at=_time(d["expires_at"]),
                       context=dict(d.get("context") or {}), fingerprint=str(d.get("fingerprint") or "")[:64],
                       fence=str(d.get("fence") or "")[:512], starts_at=str(d.get("starts_at") or "")[:64])
        except ProtocolError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ProtocolError(f"malformed command: {exc}") from None


def command_of_record(record_id: str, decided: str, expires_ms: int, send: str) -> Command:
    """The command a record stands for, rebuilt from what was decided (its `d`), its expiry and the actions it
    sends: what an applier applies once the signature over command_message checked out."""
    try:
        # NaN and Infinity parse as 1e999 already does, so the action is refused where its params are checked.
        d = json.loads(decided, parse_constant=float)
        steps = d["s"]
        indexes = [int(i) for i in send.split()] if send else list(range(len(steps)))
        actions = []
        for i in indexes:
            action, params, *more = steps[i]
            flags = more[0] if more and isinstance(more[0], dict) else {}
            actions.append(ActionCall(i, str(action), dict(params or {}), flags.get("o") is True))
        alert = d.get("a") or {}
        starts_at = str(alert.get("starts_at") or "")[:64]
        fingerprint = str(alert.get("fingerprint") or "")[:64]
        start = str(d.get("st") or alert_second(starts_at))
        t = keys.target_of_record(record_id)
        expires = _time(expires_ms) / 1000
        return Command(record_id=record_id, kind=t.kind, target=t.name, actions=tuple(actions),
                       issued_at=expires - _time(d["x"]), expires_at=expires, context=dict(d.get("c") or {}),
                       fingerprint=fingerprint, fence=fence(fingerprint, start, str(d["p"]), int(d.get("g") or 0),
                                                            str(d.get("m") or "firing"))[:512],
                       starts_at=starts_at)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        raise ProtocolError(f"malformed record: {exc}") from None


def _time(value: Any) -> float:
    t = float(value)
    if not math.isfinite(t):  # an expiry of NaN or infinity would never pass
        raise ValueError(f"{value!r} is not a finite time")
    return t


@dataclass(frozen=True)
class Ack:
    """An applier's answer for one action of a command.

    `reason` is a short code (no_cuda, dry_run, unsupported, already_drained, ...) or None; `result` is what
    the action reports, with "error" (one sentence) when it failed and "message" when it was skipped.
    """

    record_id: str
    index: int
    action: str
    status: str
    result: dict[str, Any]
    acked_by: str
    acked_at: str = field(default_factory=rfc3339)
    reason: str | None = None
    replayed: bool = False
