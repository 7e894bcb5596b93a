"""Alertmanager webhook payloads (version 4) parsed into frozen dataclasses at the boundary."""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import MappingProxyType
from typing import Any
from collections.abc import Mapping

from ..errors import BadRequest

_TIME = re.compile(r"^([0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2})(\.[0-9]+)?(Z|[+-][0-9]{2}:[0-9]{2})\Z")
# What a fingerprint may hold (the OpenAPI schema says the same with this pattern).
FINGERPRINT_PATTERN = "^[A-Za-z0-9]{0,64}$"
_FINGERPRINT = re.compile(r"^[A-Za-z0-9]{1,64}\Z")
MAX_ALERTS = 1000


@dataclass(frozen=True)
class Alert:
    """One alert of a notification, as Alertmanager sent it."""

    status: str
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    starts_at: str
    ends_at: str
    fingerprint: str
    # startsAt in UTC at second precision: stable across resends and the resolved notification.
    episode_start: str
    generator_url: str = ""

    @property
    def alertname(self) -> str:
        return self.labels.get("alertname", "")

    def as_dict(self) -> dict:
        """The alert as a record shows it (records.capped_alert caps the annotations)."""
        return {"alertname": self.alertname, "status": self.status, "fingerprint": self.fingerprint,
                "starts_at": self.starts_at, "ends_at": self.ends_at, "labels": dict(self.labels),
                "annotations": dict(self.annotations), "generator_url": self.generator_url}


def alert_of_record(a: Mapping[str, Any], status: str, fingerprint: str) -> Alert:
    """The alert a record was made for, again (for its on_resolved record or its next escalation stage)."""
    labels = {str(k): str(v) for k, v in (a.get("labels") or {}).items()}
    starts = str(a.get("starts_at") or "1970-01-01T00:00:00Z")
    notes = {str(k): str(v) for k, v in (a.get("annotations") or {}).items()} if status == "firing" else {}
    return Alert(status=status, labels=labels, annotations=notes, starts_at=starts, ends_at="",
                 fingerprint=fingerprint, episode_start=episode_start(starts),
                 generator_url=str(a.get("generator_url") or ""))


@dataclass(frozen=True)
class AlertGroup:
    """One webhook notification: a group of alerts."""

    receiver: str
    status: str
    alerts: tuple[Alert, ...]
    group_key: str = ""
    external_url: str = ""


def episode_start(text: str) -> str:
    """An RFC 3339 time in UTC to the second: the episode's start (ValueError for a time that is not one)."""
    m = _TIME.match(text)
    if not m:
        raise ValueError(text)
    t = m.group(1)
    # Constructing the datetime validates the fields (month 13 is refused) far faster than strptime.
    dt = datetime(int(t[0:4]), int(t[5:7]), int(t[8:10]), int(t[11:13]), int(t[14:16]), int(t[17:19]))
    zone = m.group(3)
    if zone == "Z":  # what Alertmanager sends: no arithmetic needed
        return t + "Z"
    hours, minutes = int(zone[1:3]), int(zone[4:6])
    if hours > 23 or minutes > 59:
        raise ValueError(text)
    offset = timedelta(hours=hours, minutes=minutes)
    try:
        utc = dt - offset if zone[0] == "+" else dt + offset
    except OverflowError:  # beyond year 9999 (or before year 1) once in UTC
        raise ValueError(text) from None
    return utc.strftime("%Y-%m-%dT%H:%M:%SZ")


def _str_map(value: Any, where: str) -> Mapping[str, str]:
    if value is None:
        return MappingProxyType({})
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise BadRequest(f"{where} must be an object of strings")
    return MappingProxyType(dict(value))


def _str(d: dict, key: str, where: str, required: bool = True) -> str:
    v = d.get(key)
    if v is None and not required:
        return ""
    if not isinstance(v, str):
        raise BadRequest(f"{where}.{key} must be a string")
    return v


def parse_alert(d: Any, where: str) -> Alert:
    """One alert object, or BadRequest saying what is wrong with it."""
    if not isinstance(d, dict):
        raise BadRequest(f"{where} must be an object")
    status = _str(d, "status", where)
    if status not in ("firing", "resolved"):
        raise BadRequest(f"{where}.status must be 'firing' or 'resolved'")
    labels = _str_map(d.get("labels"), f"{where}.labels")
    if not labels.get("alertname"):
        raise BadRequest(f"{where}.labels must include alertname")
    starts_at = _str(d, "startsAt", where)
    try:
        start = episode_start(starts_at)
    except ValueError:
        raise BadRequest(f"{where}.startsAt is not an RFC 3339 time") from None
    fingerprint = _str(d, "fingerprint", where, required=False)
    if not fingerprint:
        # Other senders may omit it; Alertmanager's own is derived from the labels too.
        fingerprint = hashlib.sha256(repr(sorted(labels.items())).encode()).hexdigest()[:16]
    elif not _FINGERPRINT.match(fingerprint):
        raise BadRequest(f"{where}.fingerprint must be 1 to 64 letters or digits")
    return Alert(status=status, labels=labels, annotations=_str_map(d.get("annotations"), f"{where}.annotations"),
                 starts_at=starts_at, ends_at=_str(d, "endsAt", where, required=False),
                 fingerprint=fingerprint, episode_start=start,
                 generator_url=_str(d, "generatorURL", where, required=False))


def parse_group(body: Any) -> AlertGroup:
    """An Alertmanager webhook body (version 4), or BadRequest with one sentence."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    version = body.get("version", "4")
    if version != "4":
        raise BadRequest(f"payload version {version!r} is not supported (Alertmanager sends \"4\")")
    alerts = body.get("alerts")
    if not isinstance(alerts, list):
        raise BadRequest("alerts must be a list")
    if len(alerts) > MAX_ALERTS:
        raise BadRequest(f"a notification may carry at most {MAX_ALERTS} alerts")
    parsed = tuple(parse_alert(a, f"alerts[{i}]") for i, a in enumerate(alerts))
    for key in ("receiver", "status", "groupKey", "externalURL"):
        if body.get(key) is not None and not isinstance(body.get(key), str):
            raise BadRequest(f"{key} must be a string")
    return AlertGroup(receiver=body.get("receiver") or "", status=body.get("status") or "",
                      alerts=parsed, group_key=body.get("groupKey") or "",
                      external_url=body.get("externalURL") or "")
