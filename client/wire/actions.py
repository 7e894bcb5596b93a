"""The action catalogue: names, target kinds and typed parameters, shared by service, agent and client."""
from __future__ import annotations

from dataclasses import dataclass, fields, MISSING
from typing import Any, Callable

from trainmedic.client.wire.durations import parse_duration

DEFAULT_CHECKPOINT_PATTERNS = (
    "checkpoint-*", "checkpoint_*", "ckpt-*", "ckpt_*", "*.ckpt", "*.pt", "*.pth",
    "*.safetensors", "epoch=*", "global_step*",
)


class ParamError(ValueError):
    """A parameter that the action does not accept."""


def _number(lo: float | None = None, hi: float | None = None, lo_open: bool = False,
            integer: bool = False) -> Callable[[str, Any], Any]:
    def check(name: str, v: Any) -> Any:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
            raise ParamError(f"{name} must be {'an integer' if integer else 'a number'}, not {v!r}")
        if lo is not None and (v <= lo if lo_open else v < lo):
            raise ParamError(f"{name} must be {'>' if lo_open else '>='} {lo}, not {v!r}")
        if hi is not None and v > hi:
            raise ParamError(f"{name} must be <= {hi}, not {v!r}")
        return v
    return check


def _duration(name: str, v: Any) -> float:
    try:
        return parse_duration(v)
    except ValueError as exc:
        raise ParamError(f"{name}: {exc}") from None


def _patterns(name: str, v: Any) -> tuple[str, ...]:
    if not isinstance(v, (list, tuple)) or not v or not all(isinstance(p, str) and p for p in v):
        raise ParamError(f"{name} must be a non-empty list of glob patterns")
    for p in v:
        if "/" in p or p in (".", ".."):
            raise ParamError(f"{name}: pattern {p!r} must name an entry, not a path")
    return tuple(v)


@dataclass(frozen=True)
class ScaleLR:
    factor: float
    min_lr: float = 0.0


@dataclass(frozen=True)
class SetLR:
    lr: float


@dataclass(frozen=True)
class NoParams:
    pass


@dataclass(frozen=True)
class ReduceBatchSize:
    factor: float = 0.5
    min: int = 1


@dataclass(frozen=True)
class PowerLimit:
    watts: float | None = None
    fraction: float | None = None
    floor_watts: float | None = None


@dataclass(frozen=True)
class DiskCleanup:
    keep_last: int = 3
    older_than: float = 7 * 86400.0
    patterns: tuple[str, ...] = DEFAULT_CHECKPOINT_PATTERNS
    max_bytes: int | None = None


@dataclass(frozen=True)
class ActionSpec:
    """What one action is: the kind of target it runs on and how to check its params."""

    name: str
    kind: str
    params_type: type
    checks: dict[str, Callable[[str, Any], Any]]

    def parse(self, params: Any) -> Any:
        """Typed params from a playbook's mapping; raises ParamError naming the allowed keys."""
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise ParamError(f"parameters of {self.name} must be a mapping")
        allowed = [f.name for f in fields(self.params_type)]
        for key in params:
            if key not in allowed:
                names = ", ".join(allowed) if allowed else "none"
                raise ParamError(f"{self.name} has no parameter {key!r} (allowed: {names})")
        values = {k: self.checks[k](k, v) for k, v in params.items()}
        for f in fields(self.params_type):
            if f.name not in values and f.default is MISSING:
                raise ParamError(f"{self.name} needs parameter {f.name!r}")
        typed = self.params_type(**values)
        if isinstance(typed, PowerLimit) and (typed.watts is None) == (typed.fraction is None):
            raise ParamError("power_limit needs exactly one of 'watts' or 'fraction'")
        return typed


def _spec(name: str, kind: str, ptype: type, **checks: Callable[[str, Any], Any]) -> ActionSpec:
    return ActionSpec(name, kind, ptype, checks)


CATALOGUE: dict[str, ActionSpec] = {s.name: s for s in (
    _spec("scale_lr", "job", ScaleLR, factor=_number(0, 10, lo_open=True), min_lr=_number(0)),
    _spec("set_lr", "job", SetLR, lr=_number(0, lo_open=True)),
    _spec("empty_cache", "job", NoParams),
    _spec("reduce_batch_size", "job", ReduceBatchSize,
          factor=_number(0, 1, lo_open=True), min=_number(1, integer=True)),
    _spec("rollback_checkpoint", "job", NoParams),
    _spec("save_checkpoint", "job", NoParams),
    _spec("stop_training", "job", NoParams),
    _spec("power_limit", "node", PowerLimit, watts=_number(1), fraction=_number(0, 1, lo_open=True),
          floor_watts=_number(1)),
    _spec("restore_power_limit", "node", NoParams),
    _spec("disk_cleanup", "node", DiskCleanup, keep_last=_number(0, integer=True),
          older_than=_duration, patterns=_patterns, max_bytes=_number(1, integer=True)),
)}
