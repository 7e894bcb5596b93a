"""Redis ACL users of one node agent or one training job: that target's own keys, and what its scripts need.

A node's credentials must not let anyone command another node (nor a job's another job): each user may touch
only keys under its own hash tag (`{node:NAME}` or `{job:NAME}`: mailbox, cursor, records, ledger, ...), its
own wake-up channel, and the few shared keys its scripts write (its heartbeat joins the live targets, and a
job's the jobs reporting training signals; its acks count in the metrics; its first heartbeat puts it among
the due targets; its refusals of forged commands are counted; the records its acks settle are journaled for
the history index). Lua scripts run with
the caller's permissions, so every command a script calls is listed; none may load scripts of its own.
config/redis/users.acl holds the same rules for the Compose stack's own agent and trainer (a test compares).
"""
from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from ..client.wire import keys

# What each kind's client and scripts call (client/receiver, client/wire/lua; HMGET reads the signed command
# of each record its mailbox names).
COMMANDS = {
    "node": ("+info", "+evalsha", "+get", "+set", "+exists", "+pexpire", "+hget", "+hmget", "+hset", "+hdel",
             "+hexists", "+hincrby", "+hincrbyfloat", "+zadd", "+zrem", "+xrange", "+xadd", "+rpush", "+sadd",
             "+subscribe", "+unsubscribe", "+publish"),
    "job": ("+info", "+client|setname", "+evalsha", "+get", "+set", "+exists", "+pexpire", "+hget", "+hmget", "+hset",
            "+hdel", "+hexists", "+hincrby", "+hincrbyfloat", "+zadd", "+zrem", "+xrange", "+xadd", "+lrange",
            "+rpush", "+ltrim", "+sadd", "+subscribe", "+unsubscribe", "+publish"),
}


def shared_keys(kind: str) -> tuple[str, ...]:
    """The keys outside its own hash tag that a target's client and scripts write."""
    shared = (keys.TARGETS, keys.live(kind), keys.METRICS, keys.DUE, keys.REJECTED, keys.HIST_JOURNAL,
              keys.HIST_DIRTY)
    # A job's heartbeat also puts it among the jobs whose training signals GET /metrics reads.
    return (*shared, keys.SIGNALS_JOBS) if kind == "job" else shared


def user_name(t: keys.Target) -> str:
    """The Redis user of one target: `trainmedic-node-NAME` or `trainmedic-job-NAME`."""
    return f"trainmedic-{t.kind}-{t.name}"


def rules(t: keys.Target) -> tuple[str, ...]:
    """The ACL rules of a target's user, after its password (target names hold no glob characters)."""
    return ("resetkeys", "resetchannels", f"~{keys.PREFIX}{t.tag}:*", *(f"~{k}" for k in shared_keys(t.kind)),
            *channels(t), "-@all", *COMMANDS[t.kind])


def channels(t: keys.Target) -> tuple[str, ...]:
    """The channels a target's user may use: its wake-up channel, and a job's detections channel."""
    own = (keys.wake_channel(t), keys.detected_channel(t)) if t.kind == "job" else (keys.wake_channel(t),)
    return tuple(f"&{c}" for c in own)


def acl_line(t: keys.Target, password: str) -> str:
    """The user as an ACL file line (the password only as its SHA-256)."""
    digest = hashlib.sha256(password.encode()).hexdigest()
    return " ".join(("user", user_name(t), "on", f"#{digest}", *rules(t)))


@dataclass(frozen=True)
class Credentials:
    """A target's new user: its ACL line, and the Redis URL to hand to that agent or job."""

    target: keys.Target
    acl_line: str
    redis_url: str
    saved: bool


def target_url(admin_url: str, t: keys.Target, password: str) -> str:
    """The admin's Redis URL with the target's user and password instead of the admin's."""
    parts = urlsplit(admin_url)
    if parts.scheme == "unix":
        # redis-py reads a unix socket's user and password from the query string as well.
        return urlunsplit(parts._replace(netloc=f"{quote(user_name(t), safe='')}:{quote(password, safe='')}@"))
    host = parts.hostname or "127.0.0.1"
    host = f"[{host}]" if ":" in host else host
    port = f":{parts.port}" if parts.port else ""
    netloc = f"{quote(user_name(t), safe='')}:{quote(password, safe='')}@{host}{port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))


def issue(r: Any, admin_url: str, t: keys.Target) -> Credentials:
    """Create the target's user, or rotate it (its old password stops working), and persist it when Redis has
    an ACL file; r is a connection allowed to run ACL SETUSER."""
    from ..client.wire.cluster import on_every_node

    password = secrets.token_urlsafe(32)
    # Redis Cluster keeps users per node: every node gets the same user.
    on_every_node(r, "ACL", "SETUSER", user_name(t), "reset", "on", f">{password}", *rules(t))
    saved = all(_aclfile(a) for a in on_every_node(r, "CONFIG", "GET", "aclfile"))
    if saved:
        on_every_node(r, "ACL", "SAVE")
    return Credentials(t, acl_line(t, password), target_url(admin_url, t, password), saved)


def _aclfile(answer: Any) -> str:
    """The aclfile of a CONFIG GET answer (a dict or a flat list, as redis-py gives it)."""
    if isinstance(answer, dict):
        return str(answer.get("aclfile") or "")
    pairs = list(answer or [])
    return str(dict(zip(pairs[::2], pairs[1::2])).get("aclfile") or "")
