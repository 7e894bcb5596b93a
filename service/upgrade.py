"""Redis data written by earlier versions, brought to today's layout once, at start."""
from __future__ import annotations

import logging
import time
from typing import Any

from trainmedic.client.wire import keys

log = logging.getLogger("trainmedic.upgrade")

# Written by versions before the episode kept its `hi`; nothing reads it.
_DROPPED = frozenset({"st"})


def playbook_states(r: Any) -> int:
    """Earlier versions kept each alert's episode, a playbook's cooldown (a string with a TTL) and its budget (a
    sorted set of record ids by time) in keys of their own; today they live in the playbook's state hash on
    the target (keys.playbook_state). Folds every old key into it and deletes it, so an upgrade forgets no
    open episode, no cooldown and no spent budget. Fields written since by this version win. Returns how
    many old keys it folded."""
    if r.exists(keys.STATES_UPGRADED):
        return 0
    now_ms = int(time.time() * 1000)
    folded = 0
    for kind in ("episode", "cooldown", "budget"):
        for key in r.scan_iter(match=f"{keys.PREFIX}{{*}}:{kind}:*", count=1000):
            head, _, rest = key.partition(f"}}:{kind}:")
            playbook, fingerprint = rest.rsplit(":", 1) if kind == "episode" else (rest, "")
            state = f"{head}}}:playbook:{playbook}"
            ttl = r.pttl(key)
            if ttl > 0:
                _fold(r, kind, key, state, fingerprint, now_ms + ttl)
                r.pexpire(state, max(ttl, r.pttl(state)))
                folded += 1
            r.delete(key)
    r.set(keys.STATES_UPGRADED, "1")
    if folded:
        log.info("folded %d episode, cooldown and budget keys of an earlier version into playbook states", folded)
    return folded


def _fold(r: Any, kind: str, key: str, state: str, fingerprint: str, until_ms: int) -> None:
    """One old key's content, written into the state where the state does not hold it already."""
    have = r.hmget(state, "cool", "runs")
    if kind == "cooldown":
        r.hset(state, "cool", max(int(have[0] or 0), until_ms))
    elif kind == "budget":
        spent = (str(int(score)) for _, score in r.zrange(key, 0, -1, withscores=True))
        r.hset(state, "runs", " ".join(sorted({*(have[1] or "").split(), *spent})))
    else:
        for name, value in r.hgetall(key).items():
            if name not in _DROPPED:
                r.hsetnx(state, keys.episode_fields(fingerprint, name)[0], value)
