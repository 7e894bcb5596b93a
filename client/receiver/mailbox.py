"""A target's side of the mailbox: read signed commands past the cursor, claim, ack, release, heartbeat.

Everything here writes the target's own keys only (its hash slot: mailbox, cursor, records, state, journal,
counts, heartbeat, ledger, detections) and tells the service on the target's own channel (keys.up_channel)
when it has something to fold in: a detection, acks that settled a record, its first heartbeat. The keys every
target shares (live targets, due targets, the history index, the metrics) are the service's alone.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any
from collections.abc import Iterable

from ..wire import keys, scripts
from ..wire.cluster import execute_then_publish
from ..wire.protocol import (ACKS, BEAT, DETECTED, HEARTBEAT_TTL, SIGNALS_TTL, Ack, Command, ProtocolError,
                             command_message, command_of_record, dumps, signals_line)
from ..wire.redis import run_scripts
from ..wire.signing import Verifier
from ..wire.status import RecordStatus

log = logging.getLogger("trainmedic.mailbox")

# The job's detections stream: a few dozen entries and two days are far more than the service needs.
DETECTIONS_MAXLEN = 100
DETECTIONS_TTL = 2 * 86400.0
# Entries read per round trip.
FETCH = 100
# Commands whose issue time a process keeps at most (for its acks' latency).
ISSUED_MAX = 10_000


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

    def __init__(self, r: Any, target: keys.Target, verifier: Verifier | None = None,
                 issued: dict[str, float] | None = None):
        self.r = r
        self.target = target
        self.verifier = verifier
        self._suffix = f"~{target.kind}~{target.name}"
        # When each record's command was issued, as its entry was read: an ack's latency counts from it (shared
        # by the mailboxes of one process's reader and writer).
        self._issued: dict[str, float] = {} if issued is None else issued

    def cursor(self) -> str:
        return str(self.r.get(keys.cursor(self.target)) or "0-0")

    def wait(self, after: str, block_ms: int) -> list[tuple[str, dict[str, str]]]:
        """Entries after `after`, waiting up to block_ms for one to arrive (XREAD BLOCK: no polling)."""
        got = self.r.xread({keys.mailbox(self.target): after}, count=FETCH, block=max(1, block_ms))
        return [(str(eid), fields) for _, entries in got or [] for eid, fields in entries]

    def fetch(self, raw: list[tuple[str, dict[str, str]]] | None = None) -> list[Entry]:
        """Entries after the saved cursor (or these), oldest first, each checked against the verify keys.

        An entry names its record (`r`: its id's head), which holds what the command is made of (`d`, what was
        decided), when it expires, which actions it sends and its signature: one more round trip reads them.
        The command is rebuilt from them, and the signature checked over exactly those bytes
        (protocol.command_message). A record an earlier version made holds its command's own bytes (`cmd`).
        """
        if raw is None:
            raw = self.r.xrange(keys.mailbox(self.target), "(" + self.cursor(), "+", count=FETCH)
        named = [rid for rid in (self._rid(f.get("r")) for _, f in raw) if rid]
        stored: dict[str, list[Any]] = {}
        if named:
            pipe = self.r.pipeline(transaction=False)
            for rid in named:
                pipe.hmget(keys.record(rid), "d", "sig", "exp", "send", "cmd")
            stored = dict(zip(named, pipe.execute()))
        out = []
        for eid, fields in raw:
            named_rid = self._rid(fields.get("r"))
            if named_rid is not None and named_rid in stored:
                out.append(self._entry(eid, named_rid, *stored[named_rid]))
            else:
                out.append(Entry(eid, None, "the entry names no record of this target"))
        return out

    def _rid(self, r: Any) -> str | None:
        """The id of the record an entry's `r` names (its head, or a whole id of an earlier version), if it is
        one of this target's."""
        if not isinstance(r, str):
            return None
        rid = r + self._suffix if len(r) == 26 else r
        if keys.RECORD_ID_RE.match(rid) and keys.target_of_record(rid) == self.target:
            return rid
        return None

    def _entry(self, eid: str, rid: str, decided: str | None, sig: str | None, exp: str | None, send: str | None,
               legacy: str | None) -> Entry:
        if (decided is None and legacy is None) or sig is None:
            # No command: its record ended (or never was); the claim says which, and nothing is applied.
            return Entry(eid, None, record_id=rid)
        if legacy is not None:  # made by an earlier version: its command's own bytes
            message, decided = str(legacy).encode(), None
        else:
            try:
                message = command_message(rid, int(exp or 0), send or "", str(decided))
            except ValueError:
                return Entry(eid, None, "the record's expiry is not a number", record_id=rid)
        if self.verifier is not None:
            # The signature is checked over the exact bytes before they are even parsed.
            if not sig:
                return Entry(eid, None, "the command is not signed", refused="unsigned")
            if not self.verifier.verify(message, sig):
                return Entry(eid, None, "the command's signature does not match a verify key",
                             refused="bad_signature")
        try:
            cmd = (command_of_record(rid, decided, int(exp or 0), send or "") if decided is not None
                   else Command.from_json(message))
            if cmd.record_id != rid or (cmd.kind, cmd.target) != (self.target.kind, self.target.name):
                raise ProtocolError("the command is for another record or target")
            if len(self._issued) >= ISSUED_MAX:
                self._issued.clear()  # commands this process never answered: only their latency is lost
            self._issued[rid] = cmd.issued_at
            return Entry(eid, cmd, record_id=rid)
        except (ProtocolError, ValueError) as exc:
            return Entry(eid, None, str(exc), record_id=rid)

    def claim(self, entry: Entry, identity: str, now: float | None = None) -> str:
        """Move the cursor past the entry and take its record: 'ok' means ours to apply (lua/claim.lua)."""
        answer = run_scripts(self.r, [scripts.claim_call(self.target, entry.entry_id, entry.record_id, identity,
                                                         time.time() if now is None else now)])[0]
        return answer.decode() if isinstance(answer, bytes) else str(answer)

    def ack(self, acks: Iterable[Ack], now: float | None = None) -> list[Any]:
        """Write acks into their records in one pipeline; returns the scripts' answers."""
        acks = list(acks)
        answers = run_scripts(self.r, scripts.ack_calls(acks, time.time() if now is None else now, self._issued))
        replayed = len({a.record_id for a in acks if a.replayed})
        if replayed:
            self.count_refused("replayed", replayed)
        for a, answer in zip(acks, answers):
            if answer and str(answer[1]) != RecordStatus.DISPATCHED:
                self._issued.pop(a.record_id, None)
        return answers

    def release(self, record_id: str) -> bool:
        """Hand a claimed command back, for the target's next process."""
        return bool(run_scripts(self.r, [scripts.release_call(record_id)])[0])

    def reapply(self, record_id: str, index: int, at: str, step: int | None, by: str) -> None:
        run_scripts(self.r, [scripts.reapply_call(record_id, index, at, step, by)])

    def ledger(self) -> list[dict[str, Any]]:
        """The job's applied scale_lr / set_lr, oldest first, each with its action and params as the record that
        applied it says; with verify keys, only those whose record's command the service signed for this job."""
        entries = []
        for raw in self.r.lrange(keys.ledger(self.target), 0, -1):
            try:
                entry = json.loads(raw)
            except ValueError:
                continue
            if isinstance(entry, dict) and isinstance(entry.get("index"), int) and self._rid(entry.get("rid")):
                entries.append(entry)
        if not entries:
            return []
        pipe = self.r.pipeline(transaction=False)
        for entry in entries:
            pipe.hmget(keys.record(str(entry["rid"])), "d", "sig", "exp", "send", "cmd")
        out = []
        for entry, fields in zip(entries, pipe.execute()):
            call = self._ledger_call(entry, *fields)
            if call is not None:
                out.append({**entry, "action": call.action, "params": dict(call.params)})
        return out

    def _ledger_call(self, entry: dict[str, Any], *fields: Any) -> Any:
        got = self._entry("ledger", str(entry["rid"]), *fields)
        if got.command is not None:
            calls = [a for a in got.command.actions if a.index == entry["index"]]
            if calls:
                return calls[0]
        if got.refused:
            self.count_refused(got.refused)
        log.warning("trainmedic: ignored an entry of %s's ledger (for %s): %s", self.target.label, entry.get("rid"),
                    got.error or "its record holds no such action")
        return None

    def detect(self, alertname: str, status: str, starts_at: str, ends_at: str, step: int | None,
               value: float | None, labels: tuple[tuple[str, str], ...] = ()) -> None:
        """Hand a detection to the service: append it to the job's own stream and tell the service on the job's
        own channel (a service that did not hear it finds it at its next look at the job). `labels`: what the
        detection names besides the job (a straggler's node and rank), as fields of the entry."""
        fields = {"alertname": alertname, "status": status, "starts_at": starts_at, "ends_at": ends_at,
                  "step": "" if step is None else str(step), "value": "" if value is None else repr(float(value)),
                  **{f"label:{name}": text for name, text in labels}}
        key = keys.detections(self.target)
        pipe = self.r.pipeline(transaction=False)
        pipe.xadd(key, fields, maxlen=DETECTIONS_MAXLEN, approximate=True)
        pipe.pexpire(key, int(DETECTIONS_TTL * 1000))
        execute_then_publish(self.r, pipe, keys.up_channel(self.target), DETECTED)

    def closed(self, info: dict[str, Any]) -> None:
        """The process closed: its last heartbeat says so (the pages stop showing it live at once), and lives out
        its own expiry, making nothing live for longer than it was."""
        self.r.set(keys.heartbeat(self.target), dumps({**info, "closed": True, "last_seen": time.time()}),
                   keepttl=True, xx=True)

    def count_refused(self, reason: str, n: int = 1) -> None:
        """Count commands this applier refused (or answered without applying), for /metrics (the service folds
        the target's counts in)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hincrby(keys.target_metrics(self.target), f"rej|{reason}", n)
        execute_then_publish(self.r, pipe, keys.up_channel(self.target), ACKS)

    def heartbeat(self, info: dict[str, Any], ttl: float = HEARTBEAT_TTL, announce: bool = False,
                  now: float | None = None, pipe: Any = None) -> None:
        """Say this target is alive, with what it wants GET /targets to show. `announce`: tell the service too
        (a process's first heartbeat, and now and then after: the service learns of a target this way, and at
        the first one it offers this process the commands a process before it claimed and never
        acknowledged). With `pipe`, the writes join it (the caller executes it, and announces)."""
        now = time.time() if now is None else now
        own = pipe is None
        pipe = self.r.pipeline(transaction=False) if own else pipe
        pipe.set(keys.heartbeat(self.target), dumps({**info, "last_seen": now}), px=int(ttl * 1000))
        signals = info.get("signals")
        if isinstance(signals, dict):
            pipe.set(keys.signals(self.target), signals_line(signals), px=int(SIGNALS_TTL * 1000))
        if not own:
            return
        if announce:
            execute_then_publish(self.r, pipe, keys.up_channel(self.target), BEAT)
        else:
            pipe.execute()
