"""The engine's outside world: the targets that are live and what they can apply, how they answer commands,
and what Prometheus answers `when:` conditions with."""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any
from collections.abc import Mapping

from ...client.wire import keys
from ...client.wire.actions import CATALOGUE

from ..prometheus import Prometheus, PrometheusError

# The process id the engine's targets heartbeat with (their identity is NAME:PID, as a real process's).
PID = 1


class Answer(StrEnum):
    """How targets answer each command, at the instant it is sent."""

    APPLIED = "applied"
    FAILED = "failed"
    NONE = "none"  # nobody takes it: it ends expired at its expire_after


def default_actions(kind: str) -> tuple[str, ...]:
    """What a target of this kind can apply, by the catalogue (the service carries out its own steps)."""
    return tuple(sorted(name for name, spec in CATALOGUE.items() if spec.kind == kind and not spec.by_service))


@dataclass(frozen=True)
class Live:
    """A target with a live process: what its heartbeat says."""

    target: keys.Target
    node: str | None = None  # a job's: where its process runs ($node, checkpoint_jobs)
    actions: tuple[str, ...] | None = None  # None: the catalogue's for its kind

    @property
    def host(self) -> str:
        return self.node or self.target.name

    @property
    def identity(self) -> str:
        return f"{self.host}:{PID}"

    def info(self) -> dict[str, Any]:
        """The heartbeat, as the training client or node agent writes it."""
        out: dict[str, Any] = {"kind": self.target.kind, "name": self.target.name, "pid": PID,
                               "actions": list(default_actions(self.target.kind) if self.actions is None
                                               else self.actions)}
        if self.target.kind == "node":
            out["host"] = self.target.name
        elif self.node:
            out.update(host=self.node, node=self.node, nodes=[self.node])
        return out


def same_query(expr: str) -> str:
    """A query with each run of white space as one space: how a test's `conditions:` keys are compared with
    what the service sends (a folded YAML `when:` keeps line breaks a test file need not copy)."""
    return " ".join(expr.split())


class Table(Prometheus):
    """`when:` results a test gives (the PromQL as sent, with $job and $node filled in); anything else is
    unknown, as when Prometheus cannot answer."""

    def __init__(self, results: Mapping[str, bool]):
        self.results = {same_query(k): v for k, v in results.items()}

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        answer = self.results.get(same_query(expr))
        if answer is None:
            raise PrometheusError("the test gives no result for it")
        return [{"metric": {}, "value": [0, "1"]}] if answer else []
