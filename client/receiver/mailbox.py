"""A target's side of the mailbox: read signed commands past the cursor, claim, ack, release, heartbeat."""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any
from collections.abc import Iterable

from ..wire import keys, records
from ..wire.protocol import (DETECTED, HEARTBEAT_TTL, LIVE_WINDOW, SIGNALS_TTL, Ack, Command, ProtocolError, dumps,
                             signals_line)
from ..wire.redis import run_scripts
from ..wire.signing import Verifier

log = logging.getLogger("trainmedic.mailbox")

CURSOR_TTL = 30 * 86400.0
MAILBOX_MAXLEN = 100
# The job's detections stream: a few dozen entries and two days are far more than the service needs.
DETECTIONS_MAXLEN = 100
DETECTIONS_TTL = 2 * 86400.0


@dataclass(frozen=True)
class Entry:
    """One mailbox entry: its stream id and the command, or why it is not one to apply."""

    entry_id: str
    command: Command | None
    error: str | None = None
    # Why the entry was refused before anything else: "unsigned" or "bad_signature" (never applied).
    refused: str | None = None
    # The record the entry names (its command's; or one whose command is gone: it ended, or never was).
    record_id: str | None = None


class Mailbox:
    """Reads and acknowledges one target's commands; every call is one short Redis round trip."""

    def __init__(self, r: Any, target: keys.Target, verifier: Verifier | None = None):
        self.r = r
        self.target = target
        self.verifier = verifier
        self.scripts = records.Scripts(r)

    def cursor(self) -> str:
        return str(self.r.get(keys.cursor(self.target)) or "0-0")

    def fetch(self, count: int = 100) -> list[Entry]:
        """Entries after the saved cursor, oldest first, each checked against the verify keys.

        An entry names its record (`r`), which holds the signed command until the record ends: one more round
        trip reads every named record's command. An entry written by an earlier version carries it (`c`, `s`).
        """
        raw = self.r.xrange(keys.mailbox(self.target), "(" + self.cursor(), "+", count=count)
        named = [f["r"] for _, f in raw if "c" not in f and self._ours(f.get("r"))]
        stored: dict[str, list[Any]] = {}
        if named:
            pipe = self.r.pipeline(transaction=False)
            for rid in named:
                pipe.hmget(keys.record(rid), "cmd", "sig")
            stored = dict(zip(named, pipe.execute()))
        out = []
        for eid, fields in raw:
            rid = fields.get("r")
            if "c" in fields:
                out.append(self._entry(eid, fields.get("c", ""), fields.get("s") or ""))
            elif rid in stored:
                text, sig = stored[rid]
                # No command: its record ended (or never was); the claim says which, and nothing is applied.
                out.append(Entry(eid, None, record_id=rid) if text is None else self._entry(eid, text, sig or ""))
            else:
                out.append(Entry(eid, None, "the entry names no record of this target"))
        return out

    def _ours(self, rid: Any) -> bool:
        """Whether an entry's `r` is the id of one of this target's records."""
        return isinstance(rid, str) and bool(keys.RECORD_ID_RE.match(rid)) and keys.target_of_record(rid) == self.target

    def _entry(self, eid: str, text: str, sig: str) -> Entry:
        if self.verifier is not None:
            # The signature is checked over the exact bytes before they are even parsed.
            if not sig:
                return Entry(eid, None, "the command is not signed", refused="unsigned")
            if not self.verifier.verify(text.encode(), sig):
                return Entry(eid, None, "the command's signature does not match a verify key",
                             refused="bad_signature")
        try:
            cmd = Command.from_json(text)
            if keys.target_of_record(cmd.record_id) != self.target or (cmd.kind, cmd.target) != (
                    self.target.kind, self.target.name):
                raise ProtocolError("the command is for another target")
            return Entry(eid, cmd, record_id=cmd.record_id)
        except (ProtocolError, ValueError) as exc:
            return Entry(eid, None, str(exc))

    def claim(self, entry: Entry, identity: str) -> str:
        """Move the cursor past the entry and take its record: 'ok' means ours to apply (lua/claim.lua)."""
        return records.claim(self.scripts, self.target, entry.entry_id, entry.record_id, identity, time.time(),
                             CURSOR_TTL)

    def ack(self, acks: Iterable[Ack]) -> list[Any]:
        """Write acks into their records in one pipeline; returns the scripts' answers."""
        acks = list(acks)
        now = time.time()
        answers = run_scripts(self.r, records.ack_calls(self.scripts, acks, now))
        replayed = len({a.record_id for a in acks if a.replayed})
        if replayed:
            self.count_refused("replayed", replayed)
        if any(a and str(a[2]) != records.RecordStatus.DISPATCHED for a in answers):
            # A record that settled has an outcome to follow: the reconciler looks at this target now.
            self.r.zadd(keys.DUE, {self.target.label: int(now * 1000)}, lt=True)
        return answers

    def release(self, record_id: str) -> bool:
        """Hand a claimed command back, for the target's next process."""
        return records.release(self.scripts, record_id, MAILBOX_MAXLEN)

    def reapply(self, record_id: str, index: int, at: str, step: int | None, by: str) -> None:
        records.reapply(self.scripts, record_id, index, at, step, by)

    def ledger(self) -> list[dict[str, Any]]:
        """The job's applied scale_lr / set_lr, oldest first; with verify keys, only entries whose action and
        params come from a command the service signed for this job (taken from those signed bytes)."""
        out = []
        for raw in self.r.lrange(keys.ledger(self.target), 0, -1):
            try:
                entry = json.loads(raw)
            except ValueError:
                continue
            if not (isinstance(entry, dict) and keys.RECORD_ID_RE.match(str(entry.get("rid", "")))):
                continue
            if self.verifier is not None:
                entry = self._signed_entry(entry)
            if entry is not None:
                out.append(entry)
        return out

    def _signed_entry(self, entry: dict[str, Any]) -> dict[str, Any] | None:
        assert self.verifier is not None
        text, sig = str(entry.get("cmd") or ""), str(entry.get("sig") or "")
        refused = "unsigned" if not sig else None if self.verifier.verify(text.encode(), sig) else "bad_signature"
        why = {"unsigned": "is not signed", "bad_signature": "has a signature no verify key matches"}.get(refused or "")
        if why is None:
            try:
                cmd = Command.from_json(text)
                [call] = [a for a in cmd.actions if a.index == entry.get("index")]
                if (cmd.record_id, cmd.kind, cmd.target) != (entry["rid"], self.target.kind, self.target.name):
                    raise ProtocolError("it names another record or target")
            except (ProtocolError, ValueError):
                why = "does not match the signed command it carries"
            else:
                return {**entry, "action": call.action, "params": dict(call.params)}
        if refused:
            self.count_refused(refused)
        log.warning("trainmedic: ignored an entry of %s's ledger (for %s) that %s", self.target.label,
                    entry.get("rid"), why)
        return None

    def detect(self, alertname: str, status: str, starts_at: str, ends_at: str, step: int | None,
               value: float | None) -> None:
        """Hand a detection to the service: append it to the job's own stream, mark the job due (the
        reconciler's look) and wake the service on the job's own detections channel (its look now)."""
        fields = {"alertname": alertname, "status": status, "starts_at": starts_at, "ends_at": ends_at,
                  "step": "" if step is None else str(step), "value": "" if value is None else repr(float(value))}
        key = keys.detections(self.target)
        pipe = self.r.pipeline(transaction=False)
        pipe.xadd(key, fields, maxlen=DETECTIONS_MAXLEN, approximate=True)
        pipe.pexpire(key, int(DETECTIONS_TTL * 1000))
        pipe.zadd(keys.DUE, {self.target.label: int(time.time() * 1000)}, lt=True)
        pipe.publish(keys.detected_channel(self.target), DETECTED)
        pipe.execute()

    def count_refused(self, reason: str, n: int = 1) -> None:
        """Count commands this applier refused (or answered without applying), for /metrics."""
        self.r.hincrby(keys.REJECTED, reason, n)

    def heartbeat(self, info: dict[str, Any], ttl: float = HEARTBEAT_TTL, first: bool = False) -> None:
        """Say this target is alive, with what it wants GET /targets to show. A process's first heartbeat also
        asks the reconciler to look at the target now: commands a process before it claimed and never
        acknowledged are offered to this one (nothing claimed is dropped)."""
        now = time.time()
        pipe = self.r.pipeline(transaction=False)
        pipe.set(keys.heartbeat(self.target), dumps({**info, "last_seen": now}), px=int(ttl * 1000))
        pipe.zadd(keys.TARGETS, {self.target.label: now})
        # Live until the heartbeat expires (and never longer than LIVE_WINDOW): /metrics counts these.
        pipe.zadd(keys.live(self.target.kind), {self.target.label: int((now + min(ttl, LIVE_WINDOW)) * 1000)})
        if first:
            pipe.zadd(keys.DUE, {self.target.label: int(now * 1000)}, lt=True)
        signals = info.get("signals")
        if isinstance(signals, dict):
            pipe.set(keys.signals(self.target), signals_line(signals), px=int(SIGNALS_TTL * 1000))
            # Among the jobs GET /metrics reads until the line expires (scrapes and hang scans prune it then);
            # the index itself goes when no job has beaten for as long.
            pipe.zadd(keys.SIGNALS_JOBS, {self.target.label: int((now + SIGNALS_TTL) * 1000)})
            pipe.pexpire(keys.SIGNALS_JOBS, int(SIGNALS_TTL * 1000))
        pipe.execute()
