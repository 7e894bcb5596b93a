"""The node agent: receives a node's commands as the training client does, applies host actions, acks."""
from __future__ import annotations

import logging
import os
import socket
import threading
from pathlib import Path
from typing import Any
from collections.abc import Sequence

import redis

from ..receiver.applier import ActionSkipped, Applier, Interrupted, Invocation
from ..receiver.inbox import Inbox
from ..receiver.mailbox import Entry
from ..wire import keys
from ..wire.redis import connect
from ..wire.signing import Verifier
from . import disk
from .nvml import PowerLimiter, inventory
from .scheduler import NONE as NO_SCHEDULER, Scheduler
from .slurm import SlurmNode
from .state import Drains, NodeState

log = logging.getLogger("trainmedic.agent")


class Agent:
    """One node's agent: the inbox threads receive and ack; the main thread applies, one command at a time."""

    def __init__(self, node: str, url: str, allow_roots: Sequence[str | os.PathLike[str]] = (), dry_run: bool = False,
                 heartbeat_interval: float = 5.0, *, state_dir: str | os.PathLike[str],
                 verifier: Verifier | None = None, scheduler: Scheduler = NO_SCHEDULER,
                 slurm_node: str | None = None):
        if not keys.TARGET_NAME_RE.match(node):
            raise ValueError("the node name must be 1 to 128 letters, digits or _.:@-")
        self.node = node
        self.url = url
        self.roots = disk.pin_roots(allow_roots)
        self.dry_run = dry_run
        self.target = keys.Target("node", node)
        self.identity = f"{socket.gethostname()}:{os.getpid()}"
        self.state = NodeState(Path(state_dir))
        self.scheduler = scheduler
        self.slurm_node = slurm_node or node
        self.gpus, self.nvml_problem = inventory()
        self.signed = verifier is not None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._r: redis.Redis | None = None
        self.power = PowerLimiter(node, self._redis, self.state)
        self.applier = Applier("node", self.identity, self.state, hint=" on this node agent")
        self.applier.register("power_limit", lambda inv: self.power.throttle(inv.typed, inv.context, self.dry_run))
        self.applier.register("restore_power_limit", lambda inv: self.power.restore(inv.context, self.dry_run))
        self.applier.register("disk_cleanup", self._disk_cleanup)
        if scheduler.name == "slurm":
            # Without a scheduler these stay unregistered: unsupported, and not in the heartbeat's actions.
            self.slurm = SlurmNode(self.slurm_node)
            drains = Drains(self.state)
            self.applier.register("drain_node", lambda inv: self.slurm.drain(
                inv.command.record_id, inv.typed.reason, drains, self.dry_run))
            self.applier.register("resume_node", lambda inv: self.slurm.resume(drains, self.dry_run))
            self.applier.register("requeue_jobs", lambda inv: self.slurm.requeue(self.dry_run))
        self.inbox = Inbox(url, self.target, self._info, self.identity, verifier,
                           heartbeat_interval=heartbeat_interval, name=f"trainmedic-agent-{node}",
                           on_ready=self._wake.set)

    def _redis(self) -> redis.Redis:
        # The main thread's own client (the inbox threads have theirs); redis-py reconnects it after a restart.
        if self._r is None:
            self._r = connect(self.url)
        return self._r

    def _info(self) -> dict[str, Any]:
        info = {"kind": "node", "name": self.node, "host": socket.gethostname(), "pid": os.getpid(),
                "gpus": self.gpus, "allow_roots": [r.path for r in self.roots], "dry_run": self.dry_run,
                "actions": self.applier.actions(), "signed": self.signed, "scheduler": self.scheduler.name}
        if self.scheduler.reason:  # why the Slurm actions are not among its actions
            info["scheduler_reason"] = self.scheduler.reason
        if self.nvml_problem:
            info["nvml"] = self.nvml_problem
        return info

    def _disk_cleanup(self, inv: Invocation) -> dict[str, Any]:
        result = disk.cleanup(self.roots, inv.typed, self.dry_run)
        if self.dry_run:
            raise ActionSkipped("dry_run", "The agent runs with --dry-run, so nothing was deleted.", **result)
        return result

    # -- applying
    def _apply_ready(self) -> None:
        while self.inbox.ready:
            entry = self.inbox.ready.popleft()
            if not isinstance(entry, Entry) or entry.command is None:
                continue
            cmd = entry.command
            try:
                acks = self.applier.apply(cmd, cmd.expired())
            except Interrupted as stop:  # a handler raised SystemExit: ack it, then stop as asked
                self.inbox.send(stop.acks)
                raise stop.original from None
            self.inbox.send(acks)

    # -- lifecycle
    def serve(self) -> None:
        """Apply commands as they arrive until stop() is called."""
        self.inbox.start()
        log.info("agent for node %s up (gpus: %d%s, allow-roots: %s, scheduler: %s%s%s)", self.node, len(self.gpus),
                 f", NVML: {self.nvml_problem.rstrip('.')}" if self.nvml_problem else "",
                 ", ".join(r.path for r in self.roots) or "none",
                 self.scheduler.name + (f" ({self.scheduler.reason})" if self.scheduler.reason else ""),
                 ", dry run" if self.dry_run else "",
                 "" if self.signed else ", UNSIGNED commands accepted (--insecure-unsigned)")
        try:
            while not self._stop.is_set():
                self._wake.wait(1.0)
                self._wake.clear()
                self._apply_ready()
        finally:
            # Claimed commands are ours alone (the cursor has moved): apply them before leaving.
            self.inbox.stop_receiving()
            self._apply_ready()
            self.inbox.close(timeout=5.0)
            if self._r is not None:
                self._r.close()
            for root in self.roots:
                os.close(root.fd)
            log.info("agent for node %s stopped", self.node)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

