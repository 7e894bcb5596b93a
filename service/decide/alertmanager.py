"""Alertmanager's API v2, as the reconciler uses it: which alerts are still active, and silences."""
from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, UTC
from collections.abc import Mapping, Sequence

from ...client.wire.protocol import parse_rfc3339

from ..http import Http, HttpError
from ..settings import DEFAULT_ALERTMANAGER_TRUST_AFTER

log = logging.getLogger("trainmedic.alertmanager")

# A just-started Alertmanager knows no alerts until Prometheus sends them again (about a minute):
# until it has been up this long, an alert it does not list is not taken as resolved
# (TRAINMEDIC_ALERTMANAGER_TRUST_AFTER sets it per service).
TRUST_AFTER_SECONDS = DEFAULT_ALERTMANAGER_TRUST_AFTER
_SILENCE_ID = re.compile(r"^[A-Za-z0-9-]{1,64}\Z")


@dataclass
class Alertmanager:
    """One Alertmanager, or the peers of a cluster tried in order (TRAINMEDIC_ALERTMANAGER_URL)."""

    urls: Sequence[str]
    timeout: float = 3.0
    trust_after: float = TRUST_AFTER_SECONDS
    _clients: list[Http] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._clients = [Http(u, timeout=self.timeout, retries=1) for u in self.urls]

    def _call(self, method: str, path: str, body: object = None) -> object:
        # The peers of a cluster gossip alerts and silences, so any one that answers will do.
        last: HttpError | None = None
        for http in self._clients:
            try:
                return http.request(method, path, body=body)
            except HttpError as exc:
                if exc.status is not None and 400 <= exc.status < 500:
                    raise  # the request is wrong: another peer would refuse it too
                last = exc
        raise last or HttpError("no Alertmanager URL is configured")

    def _get(self, path: str) -> object:
        return self._call("GET", path)

    def create_silence(self, labels: Mapping[str, str], seconds: float, comment: str) -> str:
        """A silence matching exactly these labels from now for `seconds`; its id. Raises HttpError."""
        now = datetime.now(UTC)
        body = {
            "matchers": [{"name": k, "value": v, "isRegex": False, "isEqual": True} for k, v in sorted(labels.items())],
            "startsAt": _utc(now), "endsAt": _utc(now + timedelta(seconds=seconds)),
            "createdBy": "trainmedic", "comment": comment,
        }
        answer = self._call("POST", "/api/v2/silences", body)
        sid = answer.get("silenceID") if isinstance(answer, dict) else None
        # The id goes into a URL path later: only what Alertmanager's ids (UUIDs) are made of.
        if not isinstance(sid, str) or not _SILENCE_ID.match(sid):
            raise HttpError("Alertmanager did not answer with a silence id")
        return sid

    def expire_silence(self, silence_id: str) -> None:
        """End a silence now (one that has ended already, or is unknown, is fine). Raises HttpError."""
        if not _SILENCE_ID.match(silence_id):
            raise HttpError("not an Alertmanager silence id")
        try:
            self._call("DELETE", f"/api/v2/silence/{silence_id}")
        except HttpError as exc:
            if exc.status == 404:
                return
            # Alertmanager answers 500 when the silence has expired already: that is what we wanted.
            state = self._call("GET", f"/api/v2/silence/{silence_id}")
            if not (isinstance(state, dict) and (state.get("status") or {}).get("state") == "expired"):
                raise exc from None

    def post_alerts(self, alerts: Sequence[Mapping[str, object]]) -> None:
        """Post alerts as Prometheus does (labels, annotations, startsAt, endsAt). Raises HttpError."""
        self._call("POST", "/api/v2/alerts", list(alerts))

    def active_alerts(self) -> tuple[list[object], frozenset[str]] | None:
        """Every alert Alertmanager holds as firing (GET /api/v2/alerts, with its state, silences and
        inhibitions), and the ids of the silences trainmedic made; None when it cannot be asked now."""
        try:
            alerts = self._get("/api/v2/alerts?active=true&silenced=true&inhibited=true&unprocessed=true")
            silences = self._get("/api/v2/silences")
        except HttpError as exc:
            log.warning("Alertmanager unavailable, so the resync waits: %s", exc.message)
            return None
        if not isinstance(alerts, list):
            return None
        return alerts, _own_silence_ids(silences)

    def active_fingerprints(self) -> set[str] | None:
        """Fingerprints of the alerts Alertmanager holds as firing (active, silenced or inhibited), or None
        when that cannot be known now (unreachable, or up too briefly to know every alert)."""
        try:
            status = self._get("/api/v2/status")
            started = _uptime_start(status)
            if started is not None and time.time() - started < self.trust_after:
                return None
            alerts = self._get("/api/v2/alerts")
        except HttpError as exc:
            log.warning("Alertmanager unavailable, so open alerts wait for their resolve_timeout: %s", exc.message)
            return None
        if not isinstance(alerts, list):
            return None
        return {str(a.get("fingerprint")) for a in alerts if isinstance(a, dict) and a.get("fingerprint")}


def _own_silence_ids(silences: object) -> frozenset[str]:
    """The ids of the silences trainmedic made (createdBy trainmedic) in GET /api/v2/silences' answer."""
    if not isinstance(silences, list):
        return frozenset()
    return frozenset(str(s["id"]) for s in silences
                     if isinstance(s, Mapping) and s.get("createdBy") == "trainmedic" and s.get("id"))


def _utc(dt: datetime) -> str:
    return dt.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _uptime_start(status: object) -> float | None:
    """When the Alertmanager answering started, from its status (None if it does not say)."""
    return parse_rfc3339(status.get("uptime") if isinstance(status, dict) else None)
