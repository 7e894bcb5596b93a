"""Where a single Redis and Redis Cluster differ, all in one place.

A cluster spreads the keys over hash slots on several nodes, and a script (or MGET, or a transaction) may only
touch the keys of one slot. Callers use these functions with either kind of client and never ask which kind
it is themselves.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot

T = TypeVar("T")

MGET_CHUNK = 5000  # keys one MGET reads (split per slot on a cluster)


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


def execute_then_publish(r: Any, pipe: Any, channel: str, message: str) -> list[Any]:
    """Run a pipeline, then publish a message: in the same round trip on a single Redis (a cluster client's
    pipelines refuse PUBLISH, so there it is one more)."""
    if is_cluster(r):
        out: list[Any] = pipe.execute()
        r.publish(channel, message)
        return out
    pipe.publish(channel, message)
    return list(pipe.execute())[:-1]


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
