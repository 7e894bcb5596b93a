"""One way to open Redis: redis://, rediss:// or unix:// URLs, with Redis Cluster detected."""
from __future__ import annotations

import os
from typing import Any

import redis
from redis.cluster import RedisCluster

DEFAULT_TIMEOUT = 2.0


def redis_url(url: str | None = None) -> str:
    """The URL given, else TRAINMEDIC_REDIS_URL; raises ValueError when neither is set."""
    url = url or os.environ.get("TRAINMEDIC_REDIS_URL")
    if not url:
        raise ValueError("no Redis URL: pass one or set TRAINMEDIC_REDIS_URL")
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"Redis URL must start with redis://, rediss:// or unix://, not {url.split(':')[0]!r}")
    return url


def connect(url: str | None = None, timeout: float = DEFAULT_TIMEOUT, **kw: Any) -> redis.Redis:
    """A client for the URL; a node of a Redis Cluster gives a cluster client (detected, not configured)."""
    url = redis_url(url)
    opts = dict(socket_timeout=timeout, socket_connect_timeout=timeout, decode_responses=True, **kw)
    r = redis.Redis.from_url(url, **opts)
    if url.startswith("unix://"):
        return r
    try:
        enabled = r.info("cluster").get("cluster_enabled") == 1
    except redis.RedisError:
        # Unreachable now: hand back the plain client; callers treat errors as "Redis down" and retry.
        return r
    if enabled:
        r.close()
        return RedisCluster.from_url(url, **opts)
    return r
