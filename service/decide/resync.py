"""The resync: nothing firing is left without its remediation when Redis loses data (README "Durability").

Redis runs AOF with `appendfsync everysec`, so a crash may lose the last second of writes, and a Redis that
comes back empty has lost everything. With Alertmanager's API configured, the reconciler compares
Alertmanager's active alerts with the episodes in Redis at least once a minute. An alert Alertmanager has
listed as active for TRAINMEDIC_RESYNC_AFTER, that matches a playbook, that is neither inhibited nor silenced
by a silence trainmedic did not make, and that has no episode is decided as if Alertmanager had sent it
(`requested_by: resync`). DECIDE's episode check makes that exactly once across replicas and against a late
notification; an applier that had applied it before the loss acknowledges it `replayed` from its own state.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any
from collections.abc import Iterable, Sequence

from ...client.logs import remediation
from ...client.wire import keys
from ...client.wire.protocol import parse_rfc3339

from ..errors import BadRequest
from ..rules.alerts import Alert, parse_alert
from ..rules.playbooks import Playbook
from ..rules.targets import resolve
from .alertmanager import Alertmanager
from .dispatch import Dispatcher, Outcome
from .plan import Decision

log = logging.getLogger("trainmedic.resync")

# How often one replica resyncs (a lease in Redis): at least once a minute, as promised.
RESYNC_EVERY = 30.0


@dataclass(frozen=True)
class Listed:
    """One alert as Alertmanager's API lists it, with what the resync needs to know about it."""

    alert: Alert
    since: float
    inhibited: bool
    silenced_by: frozenset[str]


def listed(raw: Any) -> Listed | None:
    """An alert of GET /api/v2/alerts, or None when it is not a firing alert trainmedic can read."""
    if not isinstance(raw, dict) or not isinstance(raw.get("status"), dict):
        return None
    state = raw["status"]
    since = parse_rfc3339(raw.get("startsAt"))
    if since is None or state.get("state") not in ("active", "suppressed"):
        return None
    try:
        alert = parse_alert({"status": "firing", "labels": raw.get("labels") or {},
                             "annotations": raw.get("annotations") or {}, "startsAt": raw["startsAt"],
                             "endsAt": "0001-01-01T00:00:00Z", "fingerprint": raw.get("fingerprint") or "",
                             "generatorURL": raw.get("generatorURL") or ""}, "alert")
    except BadRequest:
        return None
    return Listed(alert, since, bool(state.get("inhibitedBy")), frozenset(map(str, state.get("silencedBy") or ())))


class Resync:
    """Decides the active alerts that Redis has no episode of."""

    def __init__(self, r: Any, dispatcher: Dispatcher, playbooks: Sequence[Playbook],
                 alertmanager: Alertmanager | None, after: float):
        self.r = r
        self.dispatcher = dispatcher
        self.playbooks = list(playbooks)
        self.alertmanager = alertmanager
        self.after = after

    def due(self) -> bool:
        """Whether this replica resyncs now (one of them every RESYNC_EVERY seconds)."""
        return self.alertmanager is not None and bool(
            self.r.set(keys.RESYNC_LEASE, "1", nx=True, px=int(RESYNC_EVERY * 1000)))

    def run(self, now: float) -> list[Outcome]:
        """One comparison; the new records it made (none when Alertmanager cannot be asked)."""
        assert self.alertmanager is not None
        state = self.alertmanager.active_alerts()
        if state is None:
            return []
        alerts, own_silences = state
        ready = [a for a in map(listed, alerts) if a is not None and a.since <= now - self.after and not a.inhibited
                 and a.silenced_by <= own_silences]
        decisions = [Decision(pb, "firing", a.alert, resolve(pb.target, a.alert.labels), requested_by="resync")
                     for a in ready for pb in self.playbooks if pb.matches(a.alert.labels)]
        missing = self.without_episode(decisions)
        if not missing:
            return []
        outcomes = [o for o in self.dispatcher.execute(missing) if o.new]
        if outcomes:
            self.r.incrby(keys.RESYNCED, len(outcomes))
        for d, o in zip(missing, outcomes):
            log.warning("resync: %s on %s was active in Alertmanager with no episode in Redis (lost writes?): "
                        "remediation %s %s", d.alert.alertname, d.target.label, o.record_id, o.status,
                        extra=remediation(o.record_id, o.fingerprint, d.target, playbook=o.playbook,
                                          alertname=d.alert.alertname, status=o.status, reason=o.reason))
        return outcomes

    def without_episode(self, decisions: Iterable[Decision]) -> list[Decision]:
        """The decisions whose alert has no episode in Redis that holds its start (one round trip)."""
        todo = [d for d in decisions if d.target.name]
        if not todo:
            return []
        pipe = self.r.pipeline(transaction=False)
        for d in todo:
            pipe.hmget(keys.target_state(d.target),
                       keys.episode_fields(d.playbook.name, d.alert.fingerprint, "open", "closed", "hi"))
        return [d for d, ep in zip(todo, pipe.execute()) if not _holds(ep, d.alert.episode_start)]


def _holds(episode: Sequence[str | None], start: str) -> bool:
    """Whether an episode (open, closed, hi) already covers an alert that started at `start`."""
    open_, closed, hi = episode
    return any(s is not None and start <= s for s in (open_, closed, hi))

