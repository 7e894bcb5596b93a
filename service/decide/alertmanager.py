"""Alertmanager's API v2, as the reconciler asks it: which alerts are still active (silences come later)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import datetime
from collections.abc import Sequence

from trainmedic.client.settings import DEFAULT_ALERTMANAGER_TRUST_AFTER

from ..http import Http, HttpError

log = logging.getLogger("trainmedic.alertmanager")

# A just-started Alertmanager knows no alerts until Prometheus sends them again (about a minute):
# until it has been up this long, an alert it does not list is not taken as resolved
# (TRAINMEDIC_ALERTMANAGER_TRUST_AFTER sets it per service).
TRUST_AFTER_SECONDS = DEFAULT_ALERTMANAGER_TRUST_AFTER


@dataclass
class Alertmanager:
    """One Alertmanager, or the peers of a cluster tried in order (TRAINMEDIC_ALERTMANAGER_URL)."""

    urls: Sequence[str]
    timeout: float = 3.0
    trust_after: float = TRUST_AFTER_SECONDS
    _clients: list[Http] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._clients = [Http(u, timeout=self.timeout, retries=1) for u in self.urls]

    def _get(self, path: str) -> object:
        last: HttpError | None = None
        for http in self._clients:
            try:
                return http.get(path)
            except HttpError as exc:
                last = exc
        raise last or HttpError("no Alertmanager URL is configured")

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


def _uptime_start(status: object) -> float | None:
    """When the Alertmanager answering started, from its status (None if it does not say)."""
    text = status.get("uptime") if isinstance(status, dict) else None
    if not isinstance(text, str):
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
