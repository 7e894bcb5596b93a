"""Redis ACL users of one node agent or one training job: that target's own keys and channel, and nothing shared.

A node's credentials must not let anyone command another node (nor a job's another job), nor stop remediation
for everyone else: each user may touch only keys under its own hash tag (`{node:NAME}` or `{job:NAME}`:
mailbox, cursor, records, state, journal, counts, heartbeat, ledger...) and publish on its own channel to the
service (keys.up_channel); the keys every target shares (live targets, due targets, the history index, the
metrics) are the service's alone, which folds in what appliers leave in their own keys (service/fold.py).
Lua scripts run with the caller's permissions, so every command a script calls is listed; none may load
scripts of its own. config/redis/users.acl holds the same rules for the Compose stack's own agent and trainer
(a test compares).
"""
from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from ..client.wire import keys

# What a target's client and scripts call (client/receiver, client/wire/lua: claim, ack, release, reapply).
COMMANDS = ("+info", "+client|setname", "+evalsha", "+get", "+set", "+exists", "+pexpire", "+hget", "+hmget",
            "+hset", "+hdel", "+hexists", "+hincrby", "+hincrbyfloat", "+zadd", "+zrem", "+xrange", "+xread",
            "+xadd", "+xtrim", "+lrange", "+rpush", "+ltrim", "+publish")


def user_name(t: keys.Target) -> str:
    """The Redis user of one target: `trainmedic-node-NAME` or `trainmedic-job-NAME`."""
    return f"trainmedic-{t.kind}-{t.name}"


def rules(t: keys.Target) -> tuple[str, ...]:
    """The ACL rules of a target's user, after its password (target names hold no glob characters)."""
    return ("resetkeys", "resetchannels", f"~{keys.PREFIX}{t.tag}:*", f"&{keys.up_channel(t)}", "-@all",
            *COMMANDS)


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
