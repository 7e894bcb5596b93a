"""The node agent: receives a node's commands like the training client does, applies host actions, acks."""
from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any, Callable, Sequence

import redis

from trainmedic.client.wire import keys
from trainmedic.client.wire.actions import CATALOGUE, ParamError
from trainmedic.client.receiver.inbox import Inbox
from trainmedic.client.receiver.mailbox import Entry, Mailbox
from trainmedic.client.wire.protocol import Ack, Command
from trainmedic.client.wire.redis import connect

from trainmedic.client.logs import remediation
from trainmedic.client.agent import disk
from trainmedic.client.agent.nvml import PowerLimiter, inventory
from trainmedic.client.receiver.outcome import ActionFailed, ActionSkipped

log = logging.getLogger("trainmedic.agent")


class _WakingInbox(Inbox):
    """An Inbox that also sets an event when commands are ready, so the agent sleeps until there is work."""

    def __init__(self, *args: Any, wake: threading.Event, **kw: Any):
        super().__init__(*args, **kw)
        self.wake = wake

    def _drain(self, mb: Mailbox) -> None:
        super()._drain(mb)
        if self.ready:
            self.wake.set()

    def stop_receiving(self, timeout: float = 3.0) -> None:
        """Stop claiming new commands (acks still go out until close())."""
        self._stop.set()
        self._threads[0].join(timeout)


class Agent:
    """One node's agent: the inbox threads receive and ack; the main thread applies, one command at a time."""

    def __init__(self, node: str, url: str, allow_roots: Sequence[str | os.PathLike] = (), dry_run: bool = False,
                 heartbeat_interval: float = 5.0):
        if not keys.TARGET_NAME_RE.match(node):
            raise ValueError("the node name must match [A-Za-z0-9_.:@-]{1,128}")
        self.node = node
        self.url = url
        self.allow_roots = disk.check_roots(allow_roots)
        self.dry_run = dry_run
        self.target = keys.Target("node", node)
        self.identity = f"{socket.gethostname()}:{os.getpid()}"
        self.gpus, self.nvml_problem = inventory()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._r: redis.Redis | None = None
        self.power = PowerLimiter(node, self._redis)
        self.inbox = _WakingInbox(url, self.target, self._info, heartbeat_interval=heartbeat_interval,
                                  name=f"trainmedic-agent-{node}", wake=self._wake)
        self._handlers: dict[str, Callable[[Any, dict], dict]] = {
            "power_limit": lambda p, ctx: self.power.throttle(p, ctx, self.dry_run),
            "restore_power_limit": lambda p, ctx: self.power.restore(ctx, self.dry_run),
            "disk_cleanup": lambda p, ctx: self._disk_cleanup(p),
        }

    def _redis(self) -> redis.Redis:
        # The main thread's own client (the inbox threads have theirs); redis-py reconnects it after a restart.
        if self._r is None:
            self._r = connect(self.url)
        return self._r

    def _info(self) -> dict:
        info = {"kind": "node", "name": self.node, "host": socket.gethostname(), "pid": os.getpid(),
                "gpus": self.gpus, "allow_roots": [str(p) for p in self.allow_roots], "dry_run": self.dry_run}
        if self.nvml_problem:
            info["nvml"] = self.nvml_problem
        return info

    def _disk_cleanup(self, params: Any) -> dict:
        result = disk.cleanup(self.allow_roots, params, self.dry_run)
        if self.dry_run:
            raise ActionSkipped({**result, "reason": "the agent runs with --dry-run"})
        return result

    # -- applying
    def apply(self, cmd: Command) -> list[Ack]:
        """Run a command's actions in order; every action gets an ack, whatever happens."""
        acks = []
        expired = cmd.expired()
        for call in cmd.actions:
            if expired:
                status, result = "expired", {"reason": "the command expired before the agent could apply it"}
            else:
                status, result = self.run(call.action, call.params, cmd.context)
            acks.append(Ack(cmd.record_id, call.index, call.action, status, result, self.identity))
            log.info("%s %s for %s: %s", call.action, status, cmd.record_id, result.get("reason", ""),
                     extra=remediation(cmd.record_id, cmd.fingerprint or None, self.target, action=call.action,
                                       status=status))
        return acks

    def run(self, action: str, params: dict, context: dict) -> tuple[str, dict]:
        """One host action: (status, result); never raises."""
        spec = CATALOGUE.get(action)
        handler = self._handlers.get(action)
        if spec is None:
            return "unsupported", {"reason": f"The node agent does not know the action {action!r}."}
        if handler is None:
            return "unsupported", {"reason": f"{action} runs in a training job, not on a node agent."}
        try:
            return "applied", handler(spec.parse(params), dict(context or {}))
        except ParamError as exc:
            return "failed", {"reason": f"Bad parameters: {exc}."}
        except ActionFailed as exc:
            log.warning("%s failed: %s", action, exc.reason)
            return "failed", exc.result
        except ActionSkipped as exc:
            return "skipped", exc.result
        except Exception as exc:  # a bug in one action must not stop the agent
            log.exception("%s raised", action)
            return "failed", {"reason": f"Unexpected error: {type(exc).__name__}: {exc}"}

    def _apply_ready(self) -> None:
        while self.inbox.ready:
            entry: Entry = self.inbox.ready.popleft()
            if entry.command is None:
                log.warning("ignored a malformed command %s (%s)", entry.entry_id, entry.error)
                continue
            self.inbox.send(self.apply(entry.command))

    # -- lifecycle
    def serve(self) -> None:
        """Apply commands as they arrive until stop() is called."""
        self.inbox.start()
        log.info("agent for node %s up (gpus: %d%s, allow-roots: %s%s)", self.node, len(self.gpus),
                 f", NVML: {self.nvml_problem.rstrip('.')}" if self.nvml_problem else "",
                 ", ".join(map(str, self.allow_roots)) or "none", ", dry run" if self.dry_run else "")
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
            log.info("agent for node %s stopped", self.node)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
