"""Redis data written by earlier versions, brought to today's layout once, at start."""
from __future__ import annotations

import logging
import time
from typing import Any

from trainmedic.client.wire import keys

log = logging.getLogger("trainmedic.upgrade")

# Set once the guards are in today's layout: later starts skip the scan.
GUARDS_DONE = keys.PREFIX + "upgraded:guards"


def guards(r: Any) -> int:
    """Earlier versions kept a playbook's cooldown (a string with a TTL) and its budget (a sorted set of record
    ids by time) in two keys per target; today both live in its guard hash (keys.guard). Folds every old pair
    into the guard hash and deletes it, so an upgrade forgets no cooldown and no spent budget. Returns how many
    old keys it folded."""
    if r.exists(GUARDS_DONE):
        return 0
    now_ms = int(time.time() * 1000)
    folded = 0
    for kind in ("cooldown", "budget"):
        for key in r.scan_iter(match=f"{keys.PREFIX}{{*}}:{kind}:*", count=1000):
            head, _, playbook = key.partition(f"}}:{kind}:")
            guard = f"{head}}}:guard:{playbook}"
            ttl = r.pttl(key)
            if ttl <= 0:
                r.delete(key)
                continue
            have = r.hmget(guard, "cool", "runs")
            if kind == "cooldown":
                cool = max(int(have[0] or 0), now_ms + ttl)
                r.hset(guard, "cool", cool)
            else:
                spent = (str(int(score)) for _, score in r.zrange(key, 0, -1, withscores=True))
                runs = sorted({*(have[1] or "").split(), *spent})
                r.hset(guard, "runs", " ".join(runs))
            r.pexpire(guard, max(ttl, r.pttl(guard)))
            r.delete(key)
            folded += 1
    r.set(GUARDS_DONE, "1")
    if folded:
        log.info("folded %d cooldown and budget keys of an earlier version into guard hashes", folded)
    return folded
