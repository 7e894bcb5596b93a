"""Which targets are live, from what the service itself reads of their heartbeats.

A training client or node agent writes its heartbeat into its own key (keys.heartbeat, with a TTL) and
announces itself on its own channel at its first heartbeat and now and then after (protocol.BEAT). The service
alone writes what every target shares: the targets it knows (keys.TARGETS, from those announcements: a
target can announce only itself) and the live targets of each kind (keys.live, from the heartbeats of the
targets it knows, as it reads them). The breaker's percent, /metrics and the hang checks count those, so no
target's password can make others look live. A live node is also noted among the nodes seen (service/lemons.py).
"""
from __future__ import annotations

import logging
import time
from typing import Any
from collections.abc import Iterable

from ..client.wire import keys
from ..client.wire.protocol import LIVE_WINDOW

from . import lemons

log = logging.getLogger("trainmedic.beats")

# Known targets read per round trip.
BATCH = 1000
# A target that sent no heartbeat for this long is forgotten.
FORGET_AFTER = 86400.0
# Live sets are brought up to date this often (a heartbeat's TTL is 30 s, the live window a minute).
REFRESH_EVERY = 5.0


def announce(r: Any, targets: Iterable[keys.Target], now: float | None = None) -> None:
    """Targets that announced themselves: known from now on, live while their heartbeat lasts, and looked at by
    the reconciler now (a process's first heartbeat: what its predecessor claimed is offered to it)."""
    ts = [t for t in dict.fromkeys(targets) if t.name]
    if not ts:
        return
    now = time.time() if now is None else now
    pipe = r.pipeline(transaction=False)
    for t in ts:
        pipe.pttl(keys.heartbeat(t))
    ttls = pipe.execute()
    pipe = r.pipeline(transaction=False)
    live = [(t, ttl) for t, ttl in zip(ts, ttls) if int(ttl) > 0]
    if live:
        pipe.zadd(keys.TARGETS, {t.label: now for t, _ in live})
        for t, ttl in live:
            pipe.zadd(keys.live(t.kind), {t.label: int(now * 1000) + min(int(ttl), int(LIVE_WINDOW * 1000))})
        pipe.zadd(keys.DUE, {t.label: int(now * 1000) for t, _ in live}, lt=True)
        lemons.seen(pipe, [t.name for t, _ in live if t.kind == "node"], now)
        pipe.execute()


def refresh(r: Any, now: float | None = None) -> int:
    """Bring the live sets up to date from the heartbeats of every known target; how many are live."""
    now = time.time() if now is None else now
    now_ms = int(now * 1000)
    pipe = r.pipeline(transaction=False)
    pipe.zremrangebyscore(keys.TARGETS, "-inf", now - FORGET_AFTER)
    for kind in keys.TARGET_KINDS:
        pipe.zremrangebyscore(keys.live(kind), "-inf", now_ms)
    pipe.execute()
    live = 0
    counted: dict[str, set[str]] = {kind: set() for kind in keys.TARGET_KINDS}
    every = [str(x) for x in r.zrange(keys.TARGETS, 0, -1)]
    for start in range(0, len(every), BATCH):
        targets = [(label, keys.parse_label(label)) for label in every[start:start + BATCH]]
        pipe = r.pipeline(transaction=False)
        for _, t in targets:
            if t is not None:
                pipe.pttl(keys.heartbeat(t))
        ttls = iter(pipe.execute())
        seen: dict[str, float] = {}
        until: dict[str, dict[str, int]] = {kind: {} for kind in keys.TARGET_KINDS}
        gone: list[str] = []
        for label, t in targets:
            if t is None:
                gone.append(label)
                continue
            ttl = int(next(ttls))
            if ttl > 0:
                seen[label] = now
                until[t.kind][label] = now_ms + min(ttl, int(LIVE_WINDOW * 1000))
                counted[t.kind].add(label)
        pipe = r.pipeline(transaction=False)
        if seen:
            pipe.zadd(keys.TARGETS, seen, xx=True)
            lemons.seen(pipe, [label[len("node:"):] for label in seen if label.startswith("node:")], now)
        for kind, scores in until.items():
            if scores:
                pipe.zadd(keys.live(kind), scores)
        if gone:
            pipe.zrem(keys.TARGETS, *gone)
        pipe.execute()
        live += len(seen)
    # Only what the service itself found live counts (nobody else writes these, but anyone with the service's
    # password could).
    for kind, labels in counted.items():
        stale = [str(x) for x in r.zrange(keys.live(kind), 0, -1) if str(x) not in labels]
        if stale:
            r.zrem(keys.live(kind), *stale)
    return live
