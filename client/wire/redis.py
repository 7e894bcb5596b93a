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


def connect(url: str | None = None, timeout: float = DEFAULT_TIMEOUT, **kw: Any) -> Any:
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


def run_scripts(r: Any, calls: list[tuple[Any, list[str], list[Any]]]) -> list[Any]:
    """EVALSHA each (script, keys, args) in one non-transactional pipeline; returns their answers.

    Works on a single Redis and on a cluster alike. A script a node does not know yet (NOSCRIPT: a fresh or
    restarted node) is loaded and only those calls are run again, so no call ever runs twice. It also skips
    the SCRIPT EXISTS round trip redis-py's own pipelines make before every execute.
    """
    if not calls:
        return []
    pipe = r.pipeline(transaction=False)
    for script, ks, args in calls:
        # execute_command, not pipe.evalsha: redis-py blocks the latter on cluster pipelines, though
        # EVALSHA routes fine by its keys (all of one call's keys share a hash slot).
        pipe.execute_command("EVALSHA", script.sha, len(ks), *ks, *args)
    answers: list[Any] = pipe.execute(raise_on_error=False)
    missing = [i for i, a in enumerate(answers) if isinstance(a, redis.exceptions.NoScriptError)]
    if missing:
        for script in {id(calls[i][0]): calls[i][0] for i in missing}.values():
            r.script_load(script.script)
        pipe = r.pipeline(transaction=False)
        for i in missing:
            script, ks, args = calls[i]
            pipe.execute_command("EVALSHA", script.sha, len(ks), *ks, *args)
        for i, a in zip(missing, pipe.execute(raise_on_error=False)):
            answers[i] = a
    for a in answers:
        if isinstance(a, Exception):
            raise a
    return answers
