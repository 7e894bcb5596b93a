"""What this training run applied (README: the training client, resuming), kept in RemediationClient.state_dict().

The Redis data is the truth for deciding; this is the truth for what was done. A command seen again (Redis
rolled back, or a resend that became a new record for the same episode, playbook and stage) is answered
with the earlier acks instead of being applied twice, also after a restart from a checkpoint.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from ..wire.actions import CATALOGUE
from ..wire.protocol import Ack, Command, dumps
from ..wire.status import ActionStatus

STATE_VERSION = 1
MAX_COMMANDS = 1000


def _plain(value: Any) -> Any:
    """value as plain JSON types (results may hold anything a handler returned)."""
    return json.loads(dumps(value))


class AppliedState:
    """Commands this run handled, by record id and by fence key; bounded to the newest MAX_COMMANDS."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._acks: OrderedDict[str, list[Ack]] = OrderedDict()  # record id -> acks
        self._fences: dict[str, str] = {}  # fence key -> record id
        # Sticky changes (record id, index) applied, then undone by a rollback to a checkpoint from before
        # them: still answered as applied to a replay, but not "applied" to the ledger's re-apply.
        self._undone: set[tuple[str, int]] = set()

    def seen(self, cmd: Command) -> list[Ack] | None:
        """The acks this run gave the command (or another record of the same fence), if any."""
        with self._lock:
            rid = cmd.record_id if cmd.record_id in self._acks else self._fences.get(cmd.fence) if cmd.fence else None
            return list(self._acks[rid]) if rid is not None and rid in self._acks else None

    def remember(self, cmd: Command, acks: list[Ack]) -> None:
        with self._lock:
            self._acks[cmd.record_id] = list(acks)
            self._acks.move_to_end(cmd.record_id)
            if cmd.fence:
                self._fences[cmd.fence] = cmd.record_id
            self._trim()

    def applied(self, record_id: str, index: int) -> bool:
        """Whether this run's state holds that action as applied."""
        with self._lock:
            if (record_id, index) in self._undone:
                return False
            return any(a.index == index and a.status == ActionStatus.APPLIED for a in self._acks.get(record_id, ()))

    def mark_applied(self, record_id: str, index: int, action: str, result: dict[str, Any], by: str) -> None:
        """Remember an action applied again from the ledger, so a later resume does not repeat it."""
        with self._lock:
            acks = [a for a in self._acks.get(record_id, []) if a.index != index]
            acks.append(Ack(record_id, index, action, "applied", _plain(result), by))
            self._acks[record_id] = sorted(acks, key=lambda a: a.index)
            self._acks.move_to_end(record_id)
            self._undone.discard((record_id, index))
            self._trim()

    def _trim(self) -> None:
        while len(self._acks) > MAX_COMMANDS:
            old, _ = self._acks.popitem(last=False)
            self._fences = {f: r for f, r in self._fences.items() if r != old}
            self._undone = {u for u in self._undone if u[0] != old}

    def state_dict(self) -> dict[str, Any]:
        """Plain and JSON-able: {"version", "commands": [[record id, fence, [[index, action, status, reason,
        result]]]], "undone": [[record id, index]]} ("undone" only after a rollback, until re-applied)."""
        with self._lock:
            fence_of = {r: f for f, r in self._fences.items()}
            out: dict[str, Any] = {"version": STATE_VERSION, "commands": [
                [rid, fence_of.get(rid, ""), [[a.index, a.action, a.status, a.reason, _plain(a.result)] for a in acks]]
                for rid, acks in self._acks.items()]}
            if self._undone:  # absent otherwise, so a state without a rollback reads as before
                out["undone"] = [[rid, i] for rid, i in sorted(self._undone)]
            return out

    def load_state_dict(self, state: Any) -> None:
        """Replace what this run remembers with a saved state (ValueError for one this version cannot read)."""
        acks, fences, undone = _parse(state)
        with self._lock:
            self._acks, self._fences, self._undone = acks, fences, undone
            self._trim()

    def rolled_back_to(self, state: Any) -> list[tuple[str, int]]:
        """Merge the state of a checkpoint the model was rolled back to; returns the sticky changes it undid.

        Nothing newer is forgotten: every command this run handled since that checkpoint (the rollback's own
        included, remembered when its apply ends) is still answered with its earlier acks, never applied
        again. Only the sticky LR changes the checkpoint lacks are marked undone, since the restored
        optimizer no longer holds them: the job's ledger applies them again (README: Guarantees, 5), once.
        """
        acks, fences, undone = _parse(state)
        with self._lock:
            # The restored optimizer holds exactly what the checkpoint had applied (less what it had undone).
            held = {(rid, a.index) for rid, items in acks.items() for a in items
                    if a.status == ActionStatus.APPLIED} - undone
            now_undone = {(rid, a.index) for rid, items in {**acks, **self._acks}.items() for a in items
                          if a.status == ActionStatus.APPLIED and _sticky(a.action) and (rid, a.index) not in held}
            merged: OrderedDict[str, list[Ack]] = OrderedDict(acks)
            for rid, items in self._acks.items():  # newer acks win, and keep their newer place
                merged[rid] = items
                merged.move_to_end(rid)
            self._acks = merged
            self._fences = {**fences, **self._fences}
            self._undone = now_undone
            self._trim()
            return sorted(now_undone)


def _sticky(action: str) -> bool:
    spec = CATALOGUE.get(action)
    return spec is not None and spec.sticky


def _parse(state: Any) -> tuple[OrderedDict[str, list[Ack]], dict[str, str], set[tuple[str, int]]]:
    """A saved state's acks by record id, fences and undone changes (ValueError for one we cannot read)."""
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        raise ValueError("not a trainmedic client state (expected the dict RemediationClient.state_dict() made)")
    acks: OrderedDict[str, list[Ack]] = OrderedDict()
    fences: dict[str, str] = {}
    try:
        for rid, fence, items in state.get("commands", []):
            acks[str(rid)] = [Ack(str(rid), int(i), str(action), str(status), dict(result or {}), "",
                                  reason=reason) for i, action, status, reason, result in items]
            if fence:
                fences[str(fence)] = str(rid)
        undone = {(str(rid), int(i)) for rid, i in state.get("undone", [])}
    except (TypeError, ValueError) as exc:
        raise ValueError(f"a damaged trainmedic client state ({exc})") from None
    return acks, fences, undone
