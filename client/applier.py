"""RemediationClient: the in-loop applier of a training job's commands."""
from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Any, Callable

from . import keys, lr as lrmod
from .actions import CATALOGUE, ParamError
from .inbox import Inbox
from .mailbox import Entry
from .protocol import Ack, Command
from .redis_conn import redis_url

log = logging.getLogger("trainmedic.client")

Handler = Callable[[dict], Any]


class RemediationClient:
    """Receives a job's commands in the background and applies them when the loop calls poll()."""

    def __init__(self, job: str | None = None, redis_url: str | None = None, optimizer: Any = None,
                 scheduler: Any = None, *, sync_every: int = 1, heartbeat_interval: float = 5.0,
                 start: bool = True):
        job = job or os.environ.get("TRAINMEDIC_JOB")
        if not job or not keys.TARGET_NAME_RE.match(job):
            raise ValueError("job must be given (or TRAINMEDIC_JOB set) and match [A-Za-z0-9_.:@-]{1,128}")
        if sync_every < 1:
            raise ValueError("sync_every must be >= 1")
        self.job = job
        self.url = _url(redis_url)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.sync_every = sync_every
        self.target = keys.Target("job", job)
        self.step: int | None = None
        self._handlers: dict[str, Handler] = {}
        self._warned: set[str] = set()
        self._dist = _Distributed.detect()
        self.identity = f"{socket.gethostname()}:{os.getpid()}"
        if self._dist.world > 1:
            self.identity += f":{self._dist.rank}"
        # Only rank 0 talks to Redis; the others get rank 0's commands through the collective.
        self._inbox: Inbox | None = None
        if self._dist.rank == 0:
            self._inbox = Inbox(self.url, self.target, self._heartbeat_info,
                                heartbeat_interval=heartbeat_interval, name=f"trainmedic-{job}")
            if start:
                self._inbox.start()

    # -- registration
    def handler(self, action: str) -> Callable[[Handler], Handler]:
        """Decorator: register fn(params) -> result dict for an action."""
        def register(fn: Handler) -> Handler:
            self._handlers[action] = fn
            return fn
        return register

    def register(self, action: str, fn: Handler) -> None:
        self._handlers[action] = fn

    # -- the hot path
    def poll(self, step: int | None = None) -> list[Ack]:
        """Apply pending commands (never raises, never waits on the network); returns their acks."""
        if step is not None:
            self.step = step
        try:
            if self._dist.world > 1:
                entries = self._dist.exchange(self, step)
            elif self._inbox is not None and self._inbox.ready:
                entries = self._take()
            else:
                return []
            return self._apply_all(entries) if entries else []
        except Exception as exc:  # the training loop is sacred
            self._warn_once("poll", "trainmedic: poll failed (%s); training continues", exc)
            return []

    def _take(self) -> list[Entry]:
        out = []
        ready = self._inbox.ready if self._inbox else None
        while ready:
            out.append(ready.popleft())
        return out

    def _apply_all(self, entries: list[Entry]) -> list[Ack]:
        acks: list[Ack] = []
        for e in entries:
            if e.command is None:
                self._warn_once("malformed", "trainmedic: ignored a malformed command (%s)", e.error)
                continue
            acks.extend(self.apply(e.command))
        if self._inbox is not None:
            self._inbox.send(acks)
        return acks

    def apply(self, cmd: Command) -> list[Ack]:
        """Apply one command's actions in order; each gives an ack."""
        acks = []
        expired = cmd.expired()
        for call in cmd.actions:
            if expired:
                status, result = "expired", {"reason": "command expired before it could be applied"}
            else:
                status, result = self._run(call.action, call.params)
            result = dict(result or {})
            if self.step is not None:
                result.setdefault("step", self.step)
            if self._dist.world > 1:
                result.setdefault("ranks", self._dist.world)
            acks.append(Ack(cmd.record_id, call.index, call.action, status, result, self.identity))
            log.info("trainmedic: %s %s for %s: %s", call.action, status, cmd.record_id, result)
        return acks

    def _run(self, action: str, params: dict) -> tuple[str, dict]:
        fn = self._handlers.get(action) or _BUILTINS.get(action)
        if fn is None:
            return "unsupported", {"reason": f"no handler registered for {action}"}
        spec = CATALOGUE.get(action)
        try:
            if spec is not None:
                spec.parse(params)
        except ParamError as exc:
            return "failed", {"error": str(exc)}
        try:
            out = fn(self, params) if action not in self._handlers else fn(params)
        except _Unsupported as exc:
            return "unsupported", {"reason": str(exc)}
        except _Skipped as exc:
            return "skipped", dict(exc.args[0])
        except Exception as exc:
            return "failed", {"error": f"{type(exc).__name__}: {exc}"}
        return "applied", out if isinstance(out, dict) else ({} if out is None else {"value": out})

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    def _heartbeat_info(self) -> dict:
        info: dict = {"kind": "job", "name": self.job, "host": socket.gethostname(), "pid": os.getpid(),
                      "ranks": self._dist.world, "step": self.step}
        if self.optimizer is not None:
            try:
                info["lr"] = lrmod.current_lrs(self.optimizer)
            except Exception:
                pass
        return info

    # -- lifecycle
    def close(self) -> None:
        """Stop the background threads, flushing queued acks briefly."""
        if self._inbox is not None:
            self._inbox.close()

    def __enter__(self) -> "RemediationClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Unsupported(Exception):
    """The action cannot run in this process (e.g. no optimizer was given)."""


class _Skipped(Exception):
    """Nothing to do here; the argument is the result dict that says why."""


def _url(url: str | None) -> str:
    try:
        return redis_url(url)
    except ValueError as exc:
        raise ValueError(f"RemediationClient: {exc}") from None


def _needs_optimizer(rc: RemediationClient) -> Any:
    if rc.optimizer is None:
        raise _Unsupported("no optimizer was given to RemediationClient")
    return rc.optimizer


def _scale_lr(rc: RemediationClient, params: dict) -> dict:
    opt = _needs_optimizer(rc)
    return lrmod.scale_lr(opt, rc.scheduler, float(params["factor"]), float(params.get("min_lr", 0.0)))


def _set_lr(rc: RemediationClient, params: dict) -> dict:
    return lrmod.set_lr(_needs_optimizer(rc), rc.scheduler, float(params["lr"]))


def _empty_cache(rc: RemediationClient, params: dict) -> dict:
    import torch

    if not torch.cuda.is_available():
        raise _Skipped({"cuda": False, "reason": "no CUDA device in this process; nothing to free"})
    before = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    return {"cuda": True, "reserved_before": before, "reserved_after": torch.cuda.memory_reserved()}


_BUILTINS: dict[str, Callable[[RemediationClient, dict], dict]] = {
    "scale_lr": _scale_lr,
    "set_lr": _set_lr,
    "empty_cache": _empty_cache,
}


class _Distributed:
    """This process's place in torch.distributed (world 1 when not initialised) and the lockstep collective."""

    def __init__(self, rank: int = 0, world: int = 1):
        self.rank = rank
        self.world = world
        self.calls = 0
        self.device: Any = None

    @classmethod
    def detect(cls) -> "_Distributed":
        try:
            import torch.distributed as dist
            if dist.is_available() and dist.is_initialized():
                return cls(dist.get_rank(), dist.get_world_size())
        except Exception:
            pass
        return cls()

    def exchange(self, rc: RemediationClient, step: int | None) -> list[Entry]:
        """Every sync_every polls, all ranks receive rank 0's pending commands (same step everywhere)."""
        self.calls += 1
        if self.calls % rc.sync_every:
            return []
        import torch
        import torch.distributed as dist

        if self.device is None:
            # NCCL only moves CUDA tensors; gloo moves CPU ones.
            nccl = dist.get_backend() == "nccl"
            self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        payload = b""
        if self.rank == 0:
            taken = rc._take()
            if taken:
                payload = json.dumps([[e.entry_id, e.command.to_json() if e.command else None, e.error]
                                      for e in taken]).encode()
        size = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        dist.broadcast(size, 0)
        n = int(size.item())
        if n == 0:
            return []
        if self.rank == 0:
            buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        else:
            buf = torch.empty(n, dtype=torch.uint8, device=self.device)
        dist.broadcast(buf, 0)
        items = json.loads(bytes(buf.cpu().tolist()).decode())
        return [Entry(eid, Command.from_json(c) if c else None, err) for eid, c, err in items]
