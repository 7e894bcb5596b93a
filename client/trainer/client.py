"""RemediationClient: the in-loop applier of a training job's commands."""
from __future__ import annotations

import logging
import os
import socket
from typing import Any, Callable

from trainmedic.client.wire import keys
from trainmedic.client.trainer import lr as lrmod
from trainmedic.client.wire.actions import CATALOGUE, ParamError
from trainmedic.client.trainer.distributed import Delivery, Ranks, env_rank
from trainmedic.client.receiver.inbox import Inbox
from trainmedic.client.wire.protocol import Ack, Command
from trainmedic.client.wire.redis import redis_url

log = logging.getLogger("trainmedic.client")

Handler = Callable[[dict], Any]


class RemediationClient:
    """Receives a job's commands in the background and applies them when the loop calls poll()."""

    def __init__(self, job: str | None = None, redis_url: str | None = None, optimizer: Any = None,
                 scheduler: Any = None, *, sync_every: int = 1, heartbeat_interval: float = 5.0,
                 max_backoff: float = 5.0, redis_timeout: float = 2.0, start: bool = True):
        job = job or os.environ.get("TRAINMEDIC_JOB")
        if not job or not keys.TARGET_NAME_RE.match(job):
            raise ValueError("job must be given (or TRAINMEDIC_JOB set) and match [A-Za-z0-9_.:@-]{1,128}")
        if not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError("sync_every must be an integer >= 1")
        self.job = job
        self.url = _url(redis_url)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.sync_every = sync_every
        self.target = keys.Target("job", job)
        self.step: int | None = None
        self._handlers: dict[str, Handler] = {}
        self._warned: set[str] = set()
        self._ranks = Ranks.detect()
        self._checked_ranks = self._ranks.world > 1
        self.identity = f"{socket.gethostname()}:{os.getpid()}"
        if self._ranks.world > 1:
            self.identity += f":{self._ranks.rank}"
        # Only rank 0 talks to Redis; the others get rank 0's commands through the collective.
        # Before init_process_group the launcher's RANK says which process that will be.
        self._inbox: Inbox | None = None
        if (self._ranks.rank if self._ranks.world > 1 else env_rank()) == 0:
            self._inbox = Inbox(self.url, self.target, self._heartbeat_info, heartbeat_interval=heartbeat_interval,
                                name=f"trainmedic-{job}", max_backoff=max_backoff, timeout=redis_timeout,
                                client_name=f"trainmedic-client:{self.identity}")
            if start:
                self._inbox.start()

    @property
    def rank(self) -> int:
        return self._ranks.rank

    @property
    def world_size(self) -> int:
        return self._ranks.world

    # -- registration
    def handler(self, action: str) -> Callable[[Handler], Handler]:
        """Decorator: register fn(params) -> result dict for an action."""
        def register(fn: Handler) -> Handler:
            self._handlers[action] = fn
            return fn
        return register

    def register(self, action: str, fn: Handler) -> None:
        """Register fn(params) -> result dict for an action."""
        self._handlers[action] = fn

    # -- the hot path
    def poll(self, step: int | None = None) -> list[Ack]:
        """Apply pending commands (never raises, never waits on the network); returns their acks."""
        if step is not None:
            self.step = step
        try:
            if not self._checked_ranks:
                self._late_ranks()
            if self._ranks.world > 1:
                if not self._ranks.due(step, self.sync_every):
                    return []
                deliveries = self._ranks.exchange(self._take)
                return self._apply_all(deliveries, ranked=True) if deliveries else []
            if self._inbox is None or not self._inbox.ready:
                return []
            return self._apply_all(self._take(), ranked=False)
        except Exception as exc:  # the training loop is sacred
            self._warn_once("poll", "trainmedic: poll failed (%s: %s); training continues", type(exc).__name__, exc)
            return []

    def _late_ranks(self) -> None:
        # The process group may have been initialised after this client was made: look once.
        self._checked_ranks = True
        ranks = Ranks.detect()
        if ranks.world > 1:
            self._ranks = ranks
            self.identity += f":{ranks.rank}"
            if ranks.rank != 0 and self._inbox is not None:
                self._warn_once("late", "trainmedic: create RemediationClient after init_process_group; "
                                "rank %s stops reading Redis", ranks.rank)
                self._release(self._take(), "this rank does not read commands; rank 0 does")
                self._inbox.close()
                self._inbox = None

    def _take(self) -> list[Delivery]:
        """Everything the inbox has received, with expiry decided now (once, on the reading rank)."""
        out: list[Delivery] = []
        ready = self._inbox.ready if self._inbox is not None else None
        while ready:
            e = ready.popleft()
            out.append(Delivery(e.entry_id, e.command, e.error,
                                e.command.expired() if e.command is not None else False))
        return out

    def _apply_all(self, deliveries: list[Delivery], ranked: bool) -> list[Ack]:
        acks: list[Ack] = []
        for d in deliveries:
            if d.command is None:
                log.warning("trainmedic: ignored a malformed command in %s's mailbox (entry %s): %s",
                            self.job, d.entry_id, d.error)
                continue
            acks.extend(self._apply(d.command, d.expired))
        if ranked:
            acks = self._agree(acks)
        if self._inbox is not None and acks:
            self._inbox.send(acks)
        return acks

    def _agree(self, acks: list[Ack]) -> list[Ack]:
        # Every rank applied the same actions: count, across ranks, how each one went.
        if not acks:  # the same on every rank, so no rank waits in a collective the others skip
            return acks
        tallies = self._ranks.tally([a.status for a in acks])
        out = []
        for a, tally in zip(acks, tallies):
            result = dict(a.result)
            result["ranks"] = self._ranks.world
            result["ranks_applied"] = tally.get("applied", 0)
            status = a.status
            if len(tally) > 1:  # the ranks disagree: that is a failure whatever rank 0 saw
                status = "failed"
                result["rank_statuses"] = tally
                result.setdefault("error", f"applied on {result['ranks_applied']} of {self._ranks.world} ranks")
            out.append(Ack(a.record_id, a.index, a.action, status, result, a.acked_by, a.acked_at))
        return out

    def apply(self, cmd: Command) -> list[Ack]:
        """Apply one command's actions in order now, in this thread; each gives an ack (not sent)."""
        return self._apply(cmd, cmd.expired())

    def _apply(self, cmd: Command, expired: bool) -> list[Ack]:
        acks = []
        for call in cmd.actions:
            if expired:
                status, result = "expired", {"reason": "the command expired before the job could apply it"}
            else:
                status, result = self._run(call.action, call.params)
            result = dict(result)
            if self.step is not None:
                result.setdefault("step", self.step)
            acks.append(Ack(cmd.record_id, call.index, call.action, status, result, self.identity))
            # JSON logs (service/logs.py) lift these fields to top-level keys; plain logs ignore them.
            extra = {"remediation_id": cmd.record_id, "fingerprint": cmd.fingerprint or None,
                     "target": self.target.label, "action": call.action, "status": status}
            if status == "failed":
                log.warning("trainmedic: %s failed for %s: %s", call.action, cmd.record_id, result.get("error"),
                            extra=extra)
            else:
                log.info("trainmedic: %s %s for %s: %s", call.action, status, cmd.record_id, result, extra=extra)
        return acks

    def _run(self, action: str, params: dict) -> tuple[str, dict]:
        user = self._handlers.get(action)
        builtin = _BUILTINS.get(action)
        if user is None and builtin is None:
            return "unsupported", {"reason": f"no handler registered for {action}"}
        spec = CATALOGUE.get(action)
        try:
            if spec is not None:
                spec.parse(params)
        except ParamError as exc:
            return "failed", {"error": str(exc)}
        try:
            out = user(params) if user is not None else builtin(self, params)  # type: ignore[misc]
        except _Unsupported as exc:
            return "unsupported", {"reason": str(exc)}
        except _Skipped as exc:
            return "skipped", dict(exc.args[0])
        except Exception as exc:  # a handler's bug is the handler's failure, not the training loop's
            return "failed", {"error": f"{type(exc).__name__}: {exc}"}
        if isinstance(out, dict):
            return "applied", out
        return "applied", {} if out is None else {"value": out}

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    def _heartbeat_info(self) -> dict:
        """What GET /targets shows for this job (called from the receiver thread)."""
        info: dict = {"kind": "job", "name": self.job, "host": socket.gethostname(), "pid": os.getpid(),
                      "ranks": self._ranks.world, "step": self.step, "sync_every": self.sync_every}
        if self.optimizer is not None:
            try:
                info["lr"] = lrmod.current_lrs(self.optimizer)
            except Exception:  # the optimizer is the loop's; a torn read is not worth a log line
                pass
        return info

    # -- lifecycle
    def close(self) -> None:
        """Stop the background threads; commands received but never applied are acked skipped."""
        unapplied = self._ranks.finish() if self._ranks.world > 1 else []
        if self._inbox is not None:
            self._release(unapplied + self._take(), "the training process ended before its next step")
            self._inbox.close()

    def _release(self, deliveries: list[Delivery], reason: str) -> None:
        acks = [Ack(d.command.record_id, c.index, c.action, "skipped", {"reason": reason}, self.identity)
                for d in deliveries if d.command is not None for c in d.command.actions]
        if acks and self._inbox is not None:
            self._inbox.send(acks)

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
    if not lrmod.optimizers_of(rc.optimizer):
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
