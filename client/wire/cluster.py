"""Where a single Redis and Redis Cluster differ, all in one place.

A cluster spreads the keys over hash slots on several nodes, and a script (or MGET, or a transaction) may only
touch the keys of one slot. Callers use these functions with either kind of client and never ask which kind
it is themselves.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot

from . import keys

T = TypeVar("T")

MGET_CHUNK = 5000  # keys one MGET reads (split per slot on a cluster)
FORWARD_BATCH = 10_000  # entries moved from one target's history journal at a time
_TAGGED = re.compile(r"^" + re.escape(keys.PREFIX) + r"\{((?:job|node):[A-Za-z0-9_.:@-]{0,128})\}:")
_LABEL = re.compile(r"^(job|node):([A-Za-z0-9_.:@-]{0,128})\Z")


def is_cluster(r: Any) -> bool:
    """Whether r is a Redis Cluster client (its keys live in many slots)."""
    return isinstance(r, RedisCluster)


def detect(r: redis.Redis, url: str, opts: dict[str, Any]) -> Any:
    """r, or a cluster client for the URL when r's node belongs to a Redis Cluster (detected, not configured)."""
    try:
        enabled = r.info("cluster").get("cluster_enabled") == 1
    except redis.RedisError:
        # Unreachable now: hand back the plain client; callers treat errors as "Redis down" and retry.
        return r
    if not enabled:
        return r
    r.close()
    return RedisCluster.from_url(url, **opts)


# -- scripts ------------------------------------------------------------------------------------------------

def scripts_reach_all(r: Any) -> bool:
    """Whether one script may touch any key (a single Redis); on a cluster only the keys of its own slot."""
    return not is_cluster(r)


def by_slot(r: Any, items: Sequence[T], tag_of: Callable[[T], str]) -> list[list[int]]:
    """The items' positions grouped by their tag's hash slot, a script call each (one group on a single Redis)."""
    if not is_cluster(r):
        return [list(range(len(items)))] if items else []
    slots: dict[int, list[int]] = {}
    for i, item in enumerate(items):
        slots.setdefault(key_slot(tag_of(item).encode()), []).append(i)
    return list(slots.values())


def mark_journaled(r: Any, script_keys: Iterable[str]) -> None:
    """Redis Cluster: name in keys.HIST_DIRTY the targets of these script keys, whose own journal may have grown."""
    # So the history indexer moves their journals before the next query. (One DECIDE_MANY call may hold several
    # targets whose tags share a slot.) A single Redis journals into the global list directly: nothing to do.
    if not is_cluster(r):
        return
    labels = {m.group(1) for m in map(_TAGGED.match, script_keys) if m}
    if labels:
        r.sadd(keys.HIST_DIRTY, *sorted(labels))


# -- reading and administering --------------------------------------------------------------------------------

def mget(r: Any, names: Sequence[str]) -> list[str | None]:
    """Values of many keys in as few round trips as the keyspace allows (slots split on a cluster)."""
    read = r.mget_nonatomic if is_cluster(r) else r.mget
    out: list[str | None] = []
    for i in range(0, len(names), MGET_CHUNK):
        out.extend(read(list(names[i:i + MGET_CHUNK])))
    return out


def on_every_node(r: Any, *args: Any) -> list[Any]:
    """One command on every node (a cluster keeps users and settings per node); their answers (redis-py merges some)."""
    if not is_cluster(r):
        return [r.execute_command(*args)]
    answer = r.execute_command(*args, target_nodes=r.ALL_NODES)
    return list(answer.values()) if isinstance(answer, dict) else [answer]


def metrics_hashes(r: Any) -> list[dict[Any, Any]]:
    """The hashes of counts GET /metrics sums (keys.metrics): the keyspace's, or on a cluster each mailbox target's."""
    if not is_cluster(r):
        return [r.hgetall(keys.METRICS)]
    labels = {str(x) for x in r.smembers(keys.MAILBOXES)}
    targets = [t for t in map(keys.parse_label, sorted(labels)) if t is not None]
    pipe = r.pipeline(transaction=False)
    for t in targets:
        pipe.hgetall(keys.metrics(t, True))
    return pipe.execute() if targets else []


# -- the history journal (service/history.py folds it into the indexes) --------------------------------------

def journal_pending(r: Any) -> bool:
    """Whether the history journal holds entries to fold, or (on a cluster) a target's own journal may."""
    return bool(r.llen(keys.HIST_JOURNAL) or (is_cluster(r) and r.exists(keys.HIST_DIRTY)))


def journal_indexed(r: Any) -> bool:
    """Whether the history journal is empty and so all before it indexed (a single Redis; never so on a cluster)."""
    # On a single Redis the fold empties the journal in the script that writes the indexes; a cluster's batch
    # spans nodes with no order between them.
    return not is_cluster(r) and not r.llen(keys.HIST_JOURNAL)


def fold_batch(r: Any, script: Callable[[], int], twin: Callable[[], int]) -> int:
    """One history fold batch: `script` on a single Redis; on a cluster, the targets' journals moved, then `twin`."""
    # `script` is one atomic script; `twin` the same fold in Python, across slots (service/history.py).
    if not is_cluster(r):
        return script()
    _forward_journals(r)
    return twin()


def _forward_journals(r: Any) -> int:
    """Redis Cluster: move the own journals of the targets named in keys.HIST_DIRTY to the global one (under
    the indexer's lock). A target is unnamed before its journal is read, so one written meanwhile is named
    again by its writer and moved next time."""
    moved = 0
    while True:
        labels = r.srandmember(keys.HIST_DIRTY, 1000)
        if not labels:
            return moved
        r.srem(keys.HIST_DIRTY, *labels)
        targets = {m.group(0): keys.Target(m.group(1), m.group(2)) for m in map(_LABEL.match, labels) if m}
        pipe = r.pipeline(transaction=False)
        for t in targets.values():
            pipe.lrange(keys.hist_journal(t), 0, FORWARD_BATCH - 1)
        got = pipe.execute()
        rids = [rid for ids in got for rid in ids]
        if not rids:
            continue
        r.rpush(keys.HIST_JOURNAL, *rids)
        pipe = r.pipeline(transaction=False)
        for t, ids in zip(targets.values(), got):
            if ids:
                pipe.ltrim(keys.hist_journal(t), len(ids), -1)
        full = [label for label, ids in zip(targets, got) if len(ids) == FORWARD_BATCH]
        if full:  # more left: next round
            pipe.sadd(keys.HIST_DIRTY, *full)
        pipe.execute()
        moved += len(rids)
