"""A target's side of the mailbox: read commands past the cursor, claim them, ack them, heartbeat."""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Iterable

import redis

from trainmedic.client.wire import keys, records as scripts
from trainmedic.client.wire.protocol import Ack, Command, ProtocolError
from trainmedic.client.wire.redis import run_scripts

log = logging.getLogger("trainmedic.mailbox")

HEARTBEAT_TTL = 30.0


@dataclass(frozen=True)
class Entry:
    """One mailbox entry: its stream id and the command, or why it is not one."""

    entry_id: str
    command: Command | None
    error: str | None = None


class Mailbox:
    """Reads and acknowledges one target's commands; every call is one short Redis round trip."""

    def __init__(self, r: redis.Redis, target: keys.Target):
        self.r = r
        self.target = target
        self._claim = r.register_script(scripts.CLAIM)
        self._ack = r.register_script(scripts.ACK)

    def cursor(self) -> str:
        return self.r.get(keys.cursor(self.target)) or "0-0"

    def fetch(self, count: int = 100) -> list[Entry]:
        """Entries after the saved cursor, oldest first."""
        raw = self.r.xrange(keys.mailbox(self.target), "(" + self.cursor(), "+", count=count)
        return [self._entry(eid, fields) for eid, fields in raw]

    def _entry(self, eid: str, fields: dict) -> Entry:
        try:
            cmd = Command.from_json(fields.get("c", ""))
            if keys.target_of_record(cmd.record_id) != self.target:
                raise ProtocolError("command is for another target")
            return Entry(eid, cmd)
        except (ProtocolError, ValueError) as exc:
            return Entry(eid, None, str(exc))

    def claim(self, entry: Entry) -> bool:
        """Move the cursor past entry and mark it delivered; False if someone already took it."""
        ks = [keys.cursor(self.target)]
        if entry.command is not None:
            ks.append(keys.record(entry.command.record_id))
        return bool(self._claim(keys=ks, args=[entry.entry_id]))

    def ack(self, acks: Iterable[Ack]) -> list:
        """Write acks into their records in one pipeline; returns the scripts' answers."""
        now_ms = int(time.time() * 1000)
        return run_scripts(self.r, [
            (self._ack, [keys.record(a.record_id), keys.ack_stats(keys.target_of_record(a.record_id))],
             [a.index, a.status, json.dumps(a.result, default=str), a.acked_at, a.acked_by, now_ms])
            for a in acks])

    def heartbeat(self, info: dict, ttl: float = HEARTBEAT_TTL) -> None:
        """Say this target is alive, with what it wants GET /targets to show."""
        now = time.time()
        pipe = self.r.pipeline(transaction=False)
        pipe.set(keys.heartbeat(self.target), json.dumps({**info, "last_seen": now}, default=str),
                 px=int(ttl * 1000))
        pipe.zadd(keys.TARGETS, {self.target.label: now})
        pipe.execute()
