"""The node agent's state file: what it applied, the power limits it replaced, the drains that are its own.

Redis may lose recent writes (a restart without persistence, a failover to a replica that lagged); this
file does not, so a command Redis hands out again is answered, not applied again, and a restore puts back
the limit from before trainmedic's first throttle, never a throttled one (so a restore after a restart is still right).
"""
from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from ..wire.protocol import Ack, Command, dumps

STATE_VERSION = 1
MAX_COMMANDS = 2000
FILE_NAME = "agent-state.json"


class NodeState:
    """One node's state, written to `<state dir>/agent-state.json` by atomic replace after every change."""

    def __init__(self, state_dir: str | os.PathLike[str]):
        self.dir = Path(state_dir)
        self.path = self.dir / FILE_NAME
        self._lock = threading.Lock()
        self._acks: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self._fences: dict[str, str] = {}
        self.power: dict[str, int] = {}  # GPU UUID -> milliwatts before trainmedic's first throttle
        self.drains: dict[str, str] = {}  # Slurm node -> record id of trainmedic's drain
        try:
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise ValueError(f"cannot use the state dir {self.dir}: {exc.strerror or exc}") from None
        self._load()

    def _load(self) -> None:
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read the agent's state file {self.path}: {exc}") from None
        if not isinstance(raw, dict) or raw.get("version") != STATE_VERSION:
            raise ValueError(f"the agent's state file {self.path} is not one this version can read")
        for rid, fence, acks in raw.get("commands", []):
            self._acks[str(rid)] = list(acks)
            if fence:
                self._fences[str(fence)] = str(rid)
        self.power = {str(k): int(v) for k, v in (raw.get("power") or {}).items()}
        self.drains = {str(k): str(v) for k, v in (raw.get("drains") or {}).items()}

    def save(self) -> None:
        """Write the whole state: a temporary file, fsync, rename over the old one, fsync the folder."""
        fence_of = {r: f for f, r in self._fences.items()}
        data = dumps({"version": STATE_VERSION, "power": self.power, "drains": self.drains,
                      "commands": [[rid, fence_of.get(rid, ""), acks] for rid, acks in self._acks.items()]})
        tmp = self.path.with_name(f".{FILE_NAME}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        dfd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    # -- Fence: what was applied
    def seen(self, cmd: Command) -> list[Ack] | None:
        with self._lock:
            rid = cmd.record_id if cmd.record_id in self._acks else self._fences.get(cmd.fence) if cmd.fence else None
            if rid is None or rid not in self._acks:
                return None
            return [Ack(rid, int(a["index"]), str(a["action"]), str(a["status"]), dict(a.get("result") or {}), "",
                        reason=a.get("reason")) for a in self._acks[rid]]

    def remember(self, cmd: Command, acks: list[Ack]) -> None:
        with self._lock:
            self._acks[cmd.record_id] = [json.loads(dumps({"index": a.index, "action": a.action, "status": a.status,
                                                           "reason": a.reason, "result": a.result})) for a in acks]
            self._acks.move_to_end(cmd.record_id)
            if cmd.fence:
                self._fences[cmd.fence] = cmd.record_id
            while len(self._acks) > MAX_COMMANDS:
                old, _ = self._acks.popitem(last=False)
                self._fences = {f: r for f, r in self._fences.items() if r != old}
            self.save()

    # -- power limits and drains (each change written at once)
    def set(self, table: str, key: str, value: Any) -> None:
        with self._lock:
            getattr(self, table)[key] = value
            self.save()

    def forget(self, table: str, key: str) -> None:
        with self._lock:
            if getattr(self, table).pop(key, None) is not None:
                self.save()


class Drains:
    """Which Slurm drains are trainmedic's (slurm.DrainMemory), kept in the node's state file."""

    def __init__(self, state: NodeState):
        self.state = state

    def ours(self, node: str) -> str | None:
        return self.state.drains.get(node)

    def remember(self, node: str, record_id: str) -> None:
        self.state.set("drains", node, record_id)

    def forget(self, node: str) -> None:
        self.state.forget("drains", node)
