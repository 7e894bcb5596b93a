"""RemediationClient: the in-loop applier of a training job's commands."""
from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any
from collections.abc import Callable

from ..receiver.applier import ActionSkipped, ActionUnsupported, Applier, Interrupted, Invocation
from ..receiver.inbox import Inbox, Ledger, Reapplied, Release
from ..receiver.mailbox import Entry
from ..settings import Settings
from ..wire import keys
from ..wire.actions import CATALOGUE
from ..wire.protocol import Ack, Command, parse_rfc3339, rfc3339
from ..wire.redis import redis_url
from ..wire.signing import SigningError, verifier_from
from . import lr as lrmod
from .distributed import Delivery, Ranks, env_rank
from .identity import job_name
from .state import STATE_VERSION, AppliedState

log = logging.getLogger("trainmedic.client")

Handler = Callable[[dict[str, Any]], Any]


class RemediationClient:
    """Receives a job's commands in the background and applies them when the loop calls poll()."""

    def __init__(self, job: str | None = None, redis_url: str | None = None, optimizer: Any = None,
                 scheduler: Any = None, *, sync_every: int = 1, heartbeat_interval: float = 5.0,
                 max_backoff: float = 5.0, redis_timeout: float = 2.0, start: bool = True,
                 verify_key: str | None = None):
        settings = Settings.from_env()
        try:
            self.job = job_name(job, os.environ)
        except ValueError as exc:
            raise ValueError(f"RemediationClient: {exc}") from None
        if not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError("RemediationClient: sync_every must be an integer >= 1")
        self.url = _url(redis_url or settings.redis_url)
        try:
            # Commands are verified when a key is given (or TRAINMEDIC_VERIFY_KEY is set); else taken unsigned.
            verifier = verifier_from([verify_key] if verify_key else settings.verify_keys)
        except SigningError as exc:
            raise ValueError(f"RemediationClient: {exc}") from None
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.sync_every = sync_every
        self.target = keys.Target("job", self.job)
        self.step: int | None = None
        self._warned: set[str] = set()
        self._lock = threading.RLock()
        self._ranks = Ranks.detect()
        self._checked_ranks = self._ranks.world > 1
        # One process, and its ranks looked at (at the first poll): poll() may answer an idle step at once.
        self._solo = False
        self.identity = f"{socket.gethostname()}:{os.getpid()}"
        if self._ranks.world > 1:
            self.identity += f":{self._ranks.rank}"
        self.state = AppliedState()
        self.applier = Applier("job", self.identity, self.state,
                               hint=" in this training process (register one with @RemediationClient.handler)")
        for action, fn in _BUILTINS.items():
            self.applier.register(action, self._builtin(fn))
        # Only rank 0 talks to Redis; the others get rank 0's commands through the collective.
        # Before init_process_group the launcher's RANK says which process that will be.
        self._inbox: Inbox | None = None
        self._ready: Any = None  # the inbox's deque: the only thing an idle poll() looks at
        if (self._ranks.rank if self._ranks.world > 1 else env_rank()) == 0:
            self._inbox = Inbox(self.url, self.target, self._heartbeat_info, self.identity, verifier,
                                heartbeat_interval=heartbeat_interval, name=f"trainmedic-{self.job}",
                                max_backoff=max_backoff, timeout=redis_timeout,
                                client_name=f"trainmedic-client:{self.identity}")
            self._ready = self._inbox.ready
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
        """Decorator: register fn(params) -> result dict for an action (replaces a built-in)."""
        def register(fn: Handler) -> Handler:
            self.register(action, fn)
            return fn
        return register

    def register(self, action: str, fn: Handler) -> None:
        """Register fn(params) -> result dict for an action; ValueError for an action that is not a job's."""
        self.applier.register(action, lambda inv: fn(inv.params))
        # The heartbeat lists what this process can apply, and the service decides by it: say so soon.
        inbox = getattr(self, "_inbox", None)
        if inbox is not None:
            inbox.beat_soon()

    def _builtin(self, fn: Callable[[RemediationClient, Invocation], Any]) -> Callable[[Invocation], Any]:
        return lambda inv: fn(self, inv)

    # -- state (Guarantees 4-6)
    def state_dict(self) -> dict[str, Any]:
        """What this run applied; save it with your checkpoint (the framework callbacks do)."""
        return self.state.state_dict()

    def load_state_dict(self, state: Any) -> None:
        """Restore what a checkpoint's run had applied; the job's ledger is then read in the background and
        sticky LR changes the restored state lacks are applied again at the next poll (never blocking it)."""
        self.state.load_state_dict(state)
        if self._inbox is not None:
            self._inbox.want_ledger()

    def rolled_back_to(self, state: Any) -> None:
        """After restoring a checkpoint mid-run (rollback_checkpoint), merge what that checkpoint had applied.

        Unlike load_state_dict nothing newer is forgotten, so no command is applied twice; the sticky LR
        changes the checkpoint lacks are applied again at a coming poll, once the ledger is read (Guarantees 5).
        """
        undone = self.state.rolled_back_to(state if state else {"version": STATE_VERSION, "commands": []})
        if undone and self._inbox is not None:
            self._inbox.want_ledger()

    @property
    def alert_start(self) -> float | None:
        """Inside a handler: when the alert behind its command began (startsAt, seconds since the epoch), or
        when the command was issued if it came without an alert (`trainmedic send`); None elsewhere."""
        inv = self.applier.current
        if inv is None:
            return None
        started = parse_rfc3339(inv.command.starts_at)
        return started if started is not None else inv.command.issued_at

    # -- the hot path
    def poll(self, step: int | None = None) -> list[Ack]:
        """Apply pending commands (never raises, never waits on the network); returns their acks."""
        if step is not None:
            self.step = step
        # The idle step of a single process: two attribute reads, nothing else (the loop is sacred).
        if self._solo and not self._ready:
            return []
        try:
            if not self._checked_ranks:
                self._late_ranks()
            if self._ranks.world > 1:
                if not self._ranks.due(step, self.sync_every):
                    return []
                with self._lock:
                    deliveries = self._ranks.exchange(self._take)
                    return self._apply_all(deliveries, ranked=True) if deliveries else []
            if not self._ready:
                return []
            with self._lock:
                return self._apply_all(self._take(), ranked=False)
        except Interrupted as stop:
            raise stop.original from None  # the user's own SystemExit / KeyboardInterrupt, acked failed first
        except Exception as exc:  # the training loop is sacred
            self._warn_once("poll", "trainmedic: poll failed (%s: %s); training continues", type(exc).__name__, exc)
            return []

    def _late_ranks(self) -> None:
        # The process group may have been initialised after this client was made: look once.
        self._checked_ranks = True
        ranks = Ranks.detect()
        self._solo = ranks.world == 1
        if ranks.world > 1:
            self._ranks = ranks
            self.identity += f":{ranks.rank}"
            self.applier.identity = self.identity
            if ranks.rank != 0 and self._inbox is not None:
                self._warn_once("late", "trainmedic: create RemediationClient after init_process_group; "
                                "rank %s stops reading Redis", ranks.rank)
                self._inbox.stop_receiving()
                self._release(self._take())
                self._inbox.close()
                self._inbox, self._ready = None, None

    def _take(self) -> list[Delivery]:
        """Everything the inbox has received, with expiry decided now (once, on the reading rank)."""
        out: list[Delivery] = []
        ready = self._ready
        while ready:
            item = ready.popleft()
            if isinstance(item, Ledger):
                out.append(Delivery("ledger", None, None, False, item.entries))
            else:
                out.append(_delivery(item))
        return out

    def _apply_all(self, deliveries: list[Delivery], ranked: bool) -> list[Ack]:
        acks: list[Ack] = []
        for i, d in enumerate(deliveries):
            if d.ledger is not None:
                self._reapply(d.ledger)
                continue
            if d.command is None:
                continue
            try:
                acks.extend(self.applier.apply(d.command, d.expired, self.step))
            except Interrupted as stop:
                # Ack what was done, hand the commands behind it back to the mailbox, then let the user stop.
                self._send(acks + stop.acks)
                self._release(deliveries[i + 1:])
                raise
        if ranked:
            acks = self._agree(acks)
        self._send(acks)
        return acks

    def _send(self, acks: list[Ack]) -> None:
        if self._inbox is not None and acks:
            self._inbox.send(acks)

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
            out.append(Ack(a.record_id, a.index, a.action, status, result, a.acked_by, a.acked_at, a.reason,
                           a.replayed))
        return out

    def _reapply(self, ledger: tuple[dict[str, Any], ...]) -> None:
        """Apply again, in order, the sticky LR changes of the job's ledger that the restored state lacks."""
        notes: list[Reapplied] = []
        for entry in ledger:
            rid, index, action = str(entry.get("rid")), int(entry.get("index", -1)), str(entry.get("action"))
            spec = CATALOGUE.get(action)
            if spec is None or not spec.sticky or self.state.applied(rid, index):
                continue  # the restored state already holds it: never apply again what the state has
            try:
                result = _STICKY[action](self, spec.parse(entry.get("params") or {}))
            except Exception as exc:
                self._warn_once(f"reapply:{rid}", "trainmedic: could not apply %s of %s again after the resume "
                                "(%s: %s)", action, rid, type(exc).__name__, exc)
                continue
            self.state.mark_applied(rid, index, action, result, self.identity)
            log.info("trainmedic: %s of %s applied again after a resume: %s", action, rid, result,
                     extra={"remediation_id": rid, "target": self.target.label, "action": action})
            notes.append(Reapplied(rid, index, rfc3339(), self.step, self.identity))
        if self._inbox is not None and notes:
            self._inbox.send(notes)

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    def _heartbeat_info(self) -> dict[str, Any]:
        """What GET /targets shows for this job (called from the receiver thread)."""
        info: dict[str, Any] = {"kind": "job", "name": self.job, "host": socket.gethostname(), "pid": os.getpid(),
                      "ranks": self._ranks.world, "step": self.step, "sync_every": self.sync_every,
                      "actions": self.applier.actions()}
        if self.optimizer is not None:
            try:
                info["lr"] = lrmod.current_lrs(self.optimizer)
            except Exception:  # the optimizer is the loop's; a torn read is not worth a log line
                pass
        return info

    # -- lifecycle
    def close(self) -> None:
        """Stop the background threads; commands received but not applied go back to the mailbox."""
        unapplied = self._ranks.finish() if self._ranks.world > 1 else []
        if self._inbox is None:
            return
        self._inbox.stop_receiving()  # first: nothing may be claimed after we look at what is left
        with self._lock:
            self._release(unapplied + self._take())
        self._inbox.close()

    def _release(self, deliveries: list[Delivery]) -> None:
        items = [Release(d.command.record_id) for d in deliveries if d.command is not None]
        if items and self._inbox is not None:
            self._inbox.send(items)

    def __enter__(self) -> RemediationClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _delivery(e: Entry) -> Delivery:
    cmd: Command | None = e.command
    return Delivery(e.entry_id, cmd, e.error, cmd.expired() if cmd is not None else False)


def _url(url: str | None) -> str:
    try:
        return redis_url(url)
    except ValueError as exc:
        raise ValueError(f"RemediationClient: {exc}") from None


def _needs_optimizer(rc: RemediationClient) -> Any:
    if not lrmod.optimizers_of(rc.optimizer):
        raise ActionUnsupported("No optimizer was given to RemediationClient.")
    return rc.optimizer


def _scale_lr(rc: RemediationClient, typed: Any) -> dict[str, Any]:
    return lrmod.scale_lr(_needs_optimizer(rc), rc.scheduler, float(typed.factor), float(typed.min_lr))


def _set_lr(rc: RemediationClient, typed: Any) -> dict[str, Any]:
    return lrmod.set_lr(_needs_optimizer(rc), rc.scheduler, float(typed.lr))


def _empty_cache(rc: RemediationClient, inv: Invocation) -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        raise ActionSkipped("no_cuda", "No CUDA device in this process, so there is nothing to free.", cuda=False)
    before = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    return {"cuda": True, "reserved_before": before, "reserved_after": torch.cuda.memory_reserved()}


# The sticky actions, by their typed params (also applied again from the ledger after a resume).
_STICKY: dict[str, Callable[[RemediationClient, Any], dict[str, Any]]] = {"scale_lr": _scale_lr, "set_lr": _set_lr}
_BUILTINS: dict[str, Callable[[RemediationClient, Invocation], Any]] = {
    "scale_lr": lambda rc, inv: _scale_lr(rc, inv.typed),
    "set_lr": lambda rc, inv: _set_lr(rc, inv.typed),
    "empty_cache": _empty_cache,
}
