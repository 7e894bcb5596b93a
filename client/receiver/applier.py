"""One applier for training clients and node agents: handlers registered per action, one result shape.

Both sides receive, claim, expire, parse, apply and acknowledge commands the same way; they differ only
in the handlers they register (checked against the action catalogue and the target kind) and in where
they keep what they applied (a Fence: the trainer's state_dict, the agent's state file).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Protocol
from collections.abc import Callable

from ..wire.actions import CATALOGUE, ParamError
from ..wire.protocol import ActionCall, Ack, Command, finite, rfc3339
from ..wire.status import ActionReason, ActionStatus

log = logging.getLogger("trainmedic.applier")

WHERE = {"job": "in a training job", "node": "on a node agent"}


def sentence(text: str) -> str:
    """text as one sentence: a capital first letter and a full stop."""
    text = text.strip()
    if not text:
        return text
    return text[0].upper() + text[1:] + ("" if text.endswith((".", "!", "?")) else ".")


class ActionFailed(Exception):
    """The action could not run; `message` is one sentence for the record, `reason` an optional short code."""

    def __init__(self, message: str, *, reason: str | None = None, **result: Any):
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.result = {"error": message, **result}


class ActionSkipped(Exception):
    """Nothing was changed on purpose; `reason` is a short code, `message` one sentence."""

    def __init__(self, reason: str, message: str, **result: Any):
        super().__init__(message)
        self.reason = reason
        self.result = {"message": message, **result}


class ActionUnsupported(Exception):
    """This process cannot run the action (no handler, no optimizer, no scheduler...)."""


@dataclass(frozen=True)
class Invocation:
    """One action as a handler sees it."""

    command: Command
    index: int
    action: str
    params: dict[str, Any]  # as the playbook wrote them
    typed: Any  # the catalogue's typed parameters (defaults filled in)
    context: dict[str, Any]  # validated alert labels the action may use (gpu_id, gpu_uuid)


Handler = Callable[[Invocation], Any]


class Fence(Protocol):
    """Where an applier keeps what it applied, so a repeat is answered, not applied again."""

    def seen(self, cmd: Command) -> list[Ack] | None:
        """The acks given for this command (by record id or fence key) if it was handled before."""

    def remember(self, cmd: Command, acks: list[Ack]) -> None:
        """Keep this command's acks."""


class Interrupted(BaseException):
    """A handler raised SystemExit or KeyboardInterrupt: send `acks`, then re-raise `original`."""

    def __init__(self, acks: list[Ack], original: BaseException):
        super().__init__(str(original))
        self.acks = acks
        self.original = original


class Applier:
    """Applies a target's commands with the handlers registered for it; never raises for a bad command."""

    def __init__(self, kind: str, identity: str, fence: Fence | None = None, hint: str = ""):
        self.kind = kind
        self.identity = identity
        self.fence = fence
        self.hint = hint  # appended to "no handler" messages: how to add one on this side
        self._handlers: dict[str, Handler] = {}
        # The action a handler is running now, for what its params do not carry (the alert's startsAt).
        self.current: Invocation | None = None

    def register(self, action: str, handler: Handler) -> None:
        """Handle `action` with handler(invocation) -> result dict; ValueError for an action of another kind."""
        spec = CATALOGUE.get(action)
        if spec is None:
            raise ValueError(f"unknown action {action!r} (known: {', '.join(sorted(CATALOGUE))})")
        if spec.kind != self.kind:
            raise ValueError(f"{action} runs on a {spec.kind}, not on a {self.kind}")
        self._handlers[action] = handler

    def actions(self) -> list[str]:
        """The actions this process can apply (what its heartbeat lists)."""
        return sorted(self._handlers)

    def apply(self, cmd: Command, expired: bool = False, step: int | None = None) -> list[Ack]:
        """Every action of the command in order, each with an ack; raises only Interrupted."""
        if self.fence is not None:
            earlier = self.fence.seen(cmd)
            if earlier is not None:
                # Handled before (Redis rolled back, or a resend became a new record): the earlier answer.
                return [dataclasses.replace(a, record_id=cmd.record_id, acked_by=self.identity, acked_at=rfc3339(),
                                            replayed=True) for a in earlier if a.index < len(cmd.actions)]
        acks: list[Ack] = []
        interrupt: BaseException | None = None
        for call in cmd.actions:
            reason: str | None
            result: dict[str, Any]
            if interrupt is not None:
                status, reason = "skipped", "interrupted"
                result = {"message": "The process stopped before this action."}
            elif expired:
                status, reason = "expired", "expired"
                result = {"message": "The command expired before it was applied."}
            else:
                try:
                    status, reason, result = self.run(cmd, call)
                except BaseException as exc:  # SystemExit / KeyboardInterrupt: the user's own stop
                    interrupt = exc
                    status, reason, result = "failed", "interrupted", {
                        "error": f"The handler stopped the process ({type(exc).__name__})."}
            if step is not None:
                result.setdefault("step", step)
            acks.append(Ack(cmd.record_id, call.index, call.action, status, result, self.identity, reason=reason))
            self._log(cmd, call, status, reason, result)
        if self.fence is not None:
            self.fence.remember(cmd, acks)
        if interrupt is not None:
            raise Interrupted(acks, interrupt)
        return acks

    def run(self, cmd: Command, call: ActionCall) -> tuple[str, str | None, dict[str, Any]]:
        """One action: (status, reason code, result); lets only SystemExit/KeyboardInterrupt through."""
        spec = CATALOGUE.get(call.action)
        handler = self._handlers.get(call.action)
        if spec is None or handler is None:
            what = (f"Unknown action {call.action!r}." if spec is None else
                    f"{call.action} runs {WHERE[spec.kind]}, not {WHERE[self.kind]}." if spec.kind != self.kind else
                    f"No handler is registered for {call.action}{self.hint}.")
            return self._unsupported(call, what)
        try:
            typed = spec.parse(call.params)
        except ParamError as exc:
            return "failed", "bad_params", {"error": f"Bad parameters for {call.action}: {exc}."}
        self.current = Invocation(cmd, call.index, call.action, dict(call.params), typed, dict(cmd.context))
        try:
            out = handler(self.current)
        except ActionFailed as exc:
            return "failed", exc.reason, dict(finite(exc.result))
        except ActionSkipped as exc:
            return "skipped", exc.reason, dict(finite(exc.result))
        except ActionUnsupported as exc:
            return self._unsupported(call, sentence(str(exc)))
        except Exception as exc:  # a handler's bug is the handler's failure, never the loop's or the agent's
            log.debug("handler for %s raised", call.action, exc_info=True)
            return "failed", None, {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            self.current = None
        if isinstance(out, dict):
            return "applied", None, dict(finite(out))
        return "applied", None, {} if out is None else {"value": finite(out)}

    @staticmethod
    def _log(cmd: Command, call: ActionCall, status: str, reason: str | None, result: dict[str, Any]) -> None:
        # JSON logs (client/logs.py) lift these fields to top-level keys; plain logs ignore them.
        extra = {"remediation_id": cmd.record_id, "fingerprint": cmd.fingerprint or None,
                 "target": f"{cmd.kind}:{cmd.target}", "action": call.action, "status": status}
        detail = result.get("error") or result.get("message") or reason or ""
        if status == ActionStatus.FAILED:
            log.warning("%s failed for %s: %s", call.action, cmd.record_id, detail, extra=extra)
        else:
            log.info("%s %s for %s%s", call.action, status, cmd.record_id, f": {detail}" if detail else "", extra=extra)

    @staticmethod
    def _unsupported(call: ActionCall, message: str) -> tuple[str, str | None, dict[str, Any]]:
        # An optional step the target cannot apply is skipped, so it fails nothing (a step's `optional:`).
        status = ActionStatus.SKIPPED if call.optional else ActionStatus.UNSUPPORTED
        return status, ActionReason.UNSUPPORTED, {"message": message}
