"""Redis data written by earlier versions, brought to today's layout once, at the first start of this one."""
from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

from ..client.wire import keys

log = logging.getLogger("trainmedic.upgrade")

# Written by versions before the episode kept its `hi`; nothing reads it.
_DROPPED = frozenset({"st"})
# One worker folds; the others wait for it this long (a worker must be up within gunicorn's timeout).
LOCK_MS = 60_000
WAIT = 25.0
BATCH = 1000


def playbook_states(r: Any) -> int:
    """Earlier versions kept each alert's episode, a playbook's cooldown (a string with a TTL) and its budget (a
    sorted set of record ids by time) in keys of their own; today they live in the playbook's state hash on
    the target (keys.playbook_state). Folds every old key into it and deletes it, so an upgrade forgets no
    open episode, no cooldown and no spent budget; fields written since by this version win. The old keys
    are found from the records the history lists (every episode and guard belongs to a record's target,
    playbook and alert), not by scanning the keyspace, which the service's Redis user may not. Returns how
    many old keys it folded."""
    if r.exists(keys.STATES_UPGRADED):
        return 0
    token = uuid.uuid4().hex
    if not r.set(keys.STATES_UPGRADING, token, nx=True, px=LOCK_MS):
        deadline = time.monotonic() + WAIT
        while not r.exists(keys.STATES_UPGRADED) and time.monotonic() < deadline:
            time.sleep(0.1)
        return 0
    folded = 0
    for ids in _history(r):
        folded += _fold_records(r, ids)
    r.set(keys.STATES_UPGRADED, "1")
    r.delete(keys.STATES_UPGRADING)
    if folded:
        log.info("folded %d episode, cooldown and budget keys of an earlier version into playbook states", folded)
    return folded


def _history(r: Any) -> Any:
    """The history's record ids, newest first, a batch at a time."""
    start = 0
    # ZRANGE ... REV (the service's Redis user has ZRANGE, not ZREVRANGE).
    while ids := r.execute_command("ZRANGE", keys.HISTORY, start, start + BATCH - 1, "REV"):
        yield ids
        start += BATCH


def _fold_records(r: Any, ids: list[str]) -> int:
    """Fold the old keys of these records' targets, playbooks and alerts; how many."""
    pipe = r.pipeline(transaction=False)
    for rid in ids:
        pipe.hmget(keys.record(rid), "playbook", "alert")
    old: dict[str, tuple[str, str, str]] = {}  # old key -> (kind, state key, fingerprint)
    for rid, (playbook, alert) in zip(ids, pipe.execute()):
        if not playbook:
            continue
        t = keys.target_of_record(rid)
        state = keys.playbook_state(t, playbook)
        head = f"{keys.PREFIX}{t.tag}"
        fingerprint = str((json.loads(alert) if alert else {}).get("fingerprint") or "")
        old[f"{head}:cooldown:{playbook}"] = ("cooldown", state, "")
        old[f"{head}:budget:{playbook}"] = ("budget", state, "")
        if fingerprint:
            old[f"{head}:episode:{playbook}:{fingerprint}"] = ("episode", state, fingerprint)
    pipe = r.pipeline(transaction=False)
    for key in old:
        pipe.pttl(key)
    now_ms = int(time.time() * 1000)
    folded = 0
    for (key, (kind, state, fingerprint)), ttl in zip(old.items(), pipe.execute()):
        if ttl > 0:
            _fold(r, kind, key, state, fingerprint, now_ms + ttl)
            r.pexpire(state, max(ttl, r.pttl(state)))
            r.delete(key)
            folded += 1
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
