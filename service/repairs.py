"""Keys of a wrong type and values that do not parse: logged once, skipped or repaired, and counted.

Trainers and agents write their own target's keys with Redis users of their own, and anyone with the service's
password can write the rest: nothing the service reads from Redis is trusted to have the shape it wrote. What
does not is left out (or rewritten in its proper shape), never a 5xx and never a stuck reconciler, and counted in
trainmedic_redis_repairs_total.
"""
from __future__ import annotations

import logging
import math
import re
import threading
from typing import Any

from ..client.wire import keys

log = logging.getLogger("trainmedic.repairs")

# What was logged already in this process (a repair repeats while nobody fixes its cause): logged once.
_logged: set[str] = set()
_lock = threading.Lock()
LOGGED_MAX = 1000


def note(r: Any, what: str, n: int = 1) -> None:
    """Count n repairs; log `what` (one sentence) the first time this process sees it."""
    with _lock:
        first = what not in _logged
        if first and len(_logged) < LOGGED_MAX:
            _logged.add(what)
    if first:
        log.warning("repaired or skipped in Redis: %s", what)
    try:
        r.incrby(keys.REPAIRS, n)
    except Exception:  # counting must never be what fails a request
        log.debug("could not count a repair", exc_info=True)


# The keys every target shares, by the type the service keeps each in (the service alone writes them).
SHARED: dict[str, str] = {
    keys.DUE: "zset", keys.HISTORY: "zset", keys.HIST_JOURNAL: "list", keys.HIST_DIRTY: "set",
    keys.HIST_FACETS: "hash", keys.TARGETS: "zset", keys.APPROVALS: "zset", keys.HUNG: "zset",
    **{keys.live(kind): "zset" for kind in keys.TARGET_KINDS},
    keys.METRICS: "hash", keys.REJECTED: "hash", keys.OUTCOME_COUNTS: "hash", keys.RESOLVE_HISTOGRAM: "hash",
    keys.UNMATCHED: "hash", keys.MARK: "hash", keys.NODES_SEEN: "zset",
    keys.HIST_SEQ: "string", keys.EPOCH: "string", keys.MARK_SEEN: "string", keys.RESETS: "string",
    keys.TAMPERED: "string", keys.RESYNCED: "string", keys.REPAIRS: "string",
}
# Those of SHARED that hold a whole number (a counter), and the hashes whose every field does.
COUNTERS = (keys.HIST_SEQ, keys.MARK_SEEN, keys.RESETS, keys.TAMPERED, keys.RESYNCED, keys.REPAIRS)
COUNTING = (keys.OUTCOME_COUNTS, keys.UNMATCHED)


def target_keys(t: keys.Target) -> dict[str, str]:
    """A target's own keys that the service reads or writes, by the type it keeps each in."""
    return {keys.target_state(t): "hash", keys.mailbox(t): "stream", keys.due_items(t): "zset",
            keys.heartbeat(t): "string", keys.cursor(t): "string", keys.journal(t): "list",
            keys.target_metrics(t): "hash", keys.ledger(t): "list", keys.detections(t): "stream",
            keys.signals(t): "string", keys.target_history(t): "zset", keys.node_incidents(t): "hash",
            keys.node_incident_times(t): "zset"}


def _whole(text: Any) -> bool:
    try:
        int(text)
    except (TypeError, ValueError):
        return False
    return True


def check(r: Any, kinds: dict[str, str]) -> int:
    """Delete those of these keys that hold another type than theirs (what they held was not trainmedic's);
    how many. A Redis error (a key it may not touch) is left to the caller."""
    names = list(kinds)
    pipe = r.pipeline(transaction=False)
    for name in names:
        pipe.type(name)
    wrong = [name for name, have in zip(names, pipe.execute()) if have not in ("none", kinds[name])]
    if wrong:
        pipe = r.pipeline(transaction=False)
        for name in wrong:
            pipe.delete(name)
        pipe.execute()
        note(r, f"{', '.join(wrong)} held another type than trainmedic keeps there: deleted", len(wrong))
    return len(wrong)


def check_shared(r: Any) -> int:
    """Repair the keys every target shares: a wrong type deleted, a counter that is not a number set anew (the
    history's sequence to its highest number in use), a count field that is not a number deleted; how many."""
    fixed = check(r, SHARED)
    pipe = r.pipeline(transaction=False)
    for name in COUNTERS:
        pipe.get(name)
    for name, value in zip(COUNTERS, pipe.execute()):
        if value is not None and not _whole(value):
            top = r.zrange(keys.HISTORY, -1, -1, withscores=True) if name == keys.HIST_SEQ else []
            r.set(name, int(top[0][1]) if top else 0)
            note(r, f"{name} held {str(value)[:40]!r}, not a count: set anew")
            fixed += 1
    for name in (*COUNTING, keys.METRICS, keys.REJECTED):
        bad = [f for f, v in r.hgetall(name).items() if not _number(v)]
        if bad:
            r.hdel(name, *bad)
            note(r, f"{name} held fields that were not counts: deleted", len(bad))
            fixed += len(bad)
    return fixed


def _number(text: Any) -> bool:
    try:
        return math.isfinite(float(text))
    except (TypeError, ValueError):
        return False


def fixable(exc: BaseException) -> bool:
    """Whether a Redis error says a key holds what trainmedic never wrote there (a repair may mend it)."""
    text = str(exc)
    return "WRONGTYPE" in text or "not an integer" in text or "not a valid float" in text


def targets_in(exc: BaseException) -> list[keys.Target]:
    """The targets whose keys a script's error names (a script's error says which key it failed on, if any)."""
    found = []
    for label in re.findall(r"\{((?:job|node):[A-Za-z0-9_.:@-]{1,128})\}", str(exc)):
        t = keys.parse_label(label)
        if t is not None:
            found.append(t)
    return found


def check_targets(r: Any, targets: Any) -> int:
    """Repair the own keys of these targets (check's rules, and a node's incident counts that are not whole
    numbers deleted); how many."""
    fixed = 0
    for t in dict.fromkeys(targets):
        if not t.name:
            continue
        fixed += check(r, target_keys(t))
        counts = keys.node_incidents(t)
        bad = [f for f, v in r.hgetall(counts).items() if not _whole(v)]
        if bad:
            r.hdel(counts, *bad)
            note(r, f"{counts} held fields that were not counts: deleted", len(bad))
            fixed += len(bad)
    return fixed
