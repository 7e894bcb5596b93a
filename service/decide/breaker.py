"""The breaker (README: "The breaker"): a playbook's `max_active` bounds how many targets may have an open
remediation of it at once, counted in Redis (lua/breaker.lua) so every worker and replica shares one count.

A claim lives in the playbook's own hash slot, a decision in its target's: on Redis Cluster one script cannot
touch both, so the same two steps run everywhere. The webhook claims a place for each firing pair of a bounded
playbook (one round trip for the notification), then DECIDE runs as usual with the refused pairs recorded
`skipped` / `breaker_open`; a claim whose pair DECIDE did not dispatch or hold (a resend, a cooldown, a dry run)
is released at once. The reconciler releases a ladder's claim when the ladder ends (resolved, applied nothing,
rejected, ineffective). A claim is a lease of LEASE seconds that the reconciler renews every RENEW_EVERY for each
remediation still open (its first record there, its ladder not ended): a claim whose record was never made (a
worker died between the claim and DECIDE) or was lost lapses within the lease. Between the claim and the
compensating release a pair holds a place it may not keep, so a burst can refuse a few alerts that a later
notification would have let through; it never lets more through than the bound. The percent form counts the
live targets the service itself saw heartbeat (service/beats.py).
"""
from __future__ import annotations

import logging
import time
from typing import Any
from collections.abc import Sequence

from ...client.wire import keys
from ...client.wire.redis import run_scripts
from ...client.wire.status import RecordStatus

from ..rules.playbooks import Playbook
from ..store.scripts import breaker_call

log = logging.getLogger("trainmedic.breaker")

# Live targets by kind are read at most this often per process: a heartbeat counts as live for a minute, so the
# percent form's base moves slowly, and the webhook saves a round trip on most notifications.
LIVE_CACHE = 1.0
# A claim lives this long unless the reconciler renews it (it does every RENEW_EVERY while the remediation is
# open).
LEASE = 30.0
RENEW_EVERY = 5.0
# What DECIDE answers for a pair that holds its claim.
HOLDS = (RecordStatus.DISPATCHED, RecordStatus.PENDING_APPROVAL)


class Breaker:
    """Claims and releases places under playbooks' max_active; see the module's docstring."""

    def __init__(self, r: Any):
        self.r = r
        self.lease = LEASE
        self._live: dict[str, tuple[float, int]] = {}

    def live(self, kind: str, now: float) -> int:
        """Live targets of a kind (heartbeats within their TTL), read at most every LIVE_CACHE seconds."""
        at, n = self._live.get(kind, (0.0, 0))
        mono = time.monotonic()
        if mono - at >= LIVE_CACHE:
            n = int(self.r.zcount(keys.live(kind), f"({int(now * 1000)}", "+inf"))
            self._live[kind] = (mono, n)
        return n

    def limit(self, pb: Playbook, now: float) -> int:
        return pb.breaker_limit(self.live(pb.target, now) if pb.max_active and pb.max_active[0] == "percent" else 0)

    def claim(self, pairs: Sequence[tuple[Playbook, str]], now: float) -> list[str]:
        """Claim a place for each (playbook, record id): 'ok', 'open' or 'opened' each, in one round trip. A
        playbook whose bound is none now (a percent of no live target) claims nothing and is let through."""
        limits = [self.limit(pb, now) for pb, _ in pairs]
        calls = [breaker_call("claim", pb.name, now, [rid], limit, self.lease)
                 for (pb, rid), limit in zip(pairs, limits) if limit]
        answers = iter(run_scripts(self.r, calls))
        return [str(next(answers)[0]) if limit else "ok" for limit in limits]

    def release(self, pairs: Sequence[tuple[Playbook, str]], now: float | None = None) -> None:
        """Give back the places of these (playbook, first record id) pairs; the breaker closes below its bound."""
        if not pairs:
            return
        now = time.time() if now is None else now
        run_scripts(self.r, [breaker_call("release", pb.name, now, [rid], self.limit(pb, now), self.lease)
                             for pb, rid in pairs])

    def renew(self, playbooks: Sequence[Playbook], now: float, still_open: Any) -> None:
        """Renew the leases of the bounded playbooks' claims whose remediation is still open (still_open(ids): the
        ids of those, from their first records), and release the others at once."""
        bounded = [pb for pb in playbooks if pb.max_active]
        if not bounded:
            return
        pipe = self.r.pipeline(transaction=False)
        for pb in bounded:
            pipe.zrangebyscore(keys.breaker_open(pb.name), f"({int(now * 1000)}", "+inf")
        claimed = [[str(m) for m in got] for got in pipe.execute()]
        open_ids = still_open([m for ms in claimed for m in ms])
        calls = []
        for pb, members in zip(bounded, claimed):
            limit = self.limit(pb, now)
            keep = [m for m in members if m in open_ids]
            done = [m for m in members if m not in open_ids]
            if done:
                calls.append(breaker_call("release", pb.name, now, done, limit, self.lease))
            calls.append(breaker_call("renew", pb.name, now, keep, limit, self.lease))
        run_scripts(self.r, calls)

    def opened(self, rid: str, playbook: str, now: float) -> None:
        """The refusal that opened the breaker: the reconciler sends its one notification from this record."""
        t = keys.target_of_record(rid)
        log.warning("breaker of playbook %s opened: %s was not dispatched", playbook, rid,
                    extra={"remediation_id": rid, "playbook": playbook})
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(keys.record(rid), mapping={"f": "1", "breaker_opened": "1"})
        pipe.zadd(keys.due_items(t), {rid: int(now * 1000)})
        pipe.zadd(keys.DUE, {t.label: int(now * 1000)}, lt=True)
        pipe.execute()

    def state(self, playbooks: Sequence[Playbook], now: float) -> dict[str, dict[str, Any]]:
        """Each bounded playbook's breaker: its bound now, the targets counted, and whether it is open."""
        bounded = [pb for pb in playbooks if pb.max_active]
        if not bounded:
            return {}
        pipe = self.r.pipeline(transaction=False)
        for pb in bounded:
            pipe.zrangebyscore(keys.breaker_open(pb.name), f"({int(now * 1000)}", "+inf")
            pipe.exists(keys.breaker_state(pb.name))
        got = pipe.execute()
        out = {}
        for i, pb in enumerate(bounded):
            members, is_open = got[2 * i], bool(got[2 * i + 1])
            active = len({m.split("~", 1)[-1] for m in members})
            out[pb.name] = {"limit": self.limit(pb, now), "active": active, "open": is_open}
        return out
