"""The action catalogue: names, target kinds and typed parameters, shared by service, agent and client."""
from __future__ import annotations

import difflib
import math
import re
from dataclasses import MISSING, dataclass, fields
from typing import Any

from .durations import MAX_SECONDS, PATTERN, SCHEMA_NOTE, parse_duration

DEFAULT_CHECKPOINT_PATTERNS = (
    "checkpoint-*", "checkpoint_*", "ckpt-*", "ckpt_*", "*.ckpt", "*.pt", "*.pth",
    "*.safetensors", "epoch=*", "global_step*",
)
# What disk_cleanup never deletes, whatever the patterns say: a `protect` list extends these.
DEFAULT_PROTECT = ("best*", "*final*", "*.json", "*.yaml", "*.yml", "*.md", "*.txt")
MAX_REASON = 200
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class ParamError(ValueError):
    """A parameter that the action does not accept."""


def is_finite_number(v: Any) -> bool:
    """A JSON/YAML number that is not NaN, an infinity, or an integer too large to be a float."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


class Check:
    """One parameter's check: called as check(name, value) -> the value, or ParamError; `schema` describes it."""

    schema: dict[str, Any] = {}

    def __call__(self, name: str, v: Any) -> Any:
        raise NotImplementedError


@dataclass(frozen=True)
class Number(Check):
    """A finite number (or integer) within bounds."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    integer: bool = False

    def __call__(self, name: str, v: Any) -> Any:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (self.integer and not isinstance(v, int)):
            raise ParamError(f"{name} must be {'an integer' if self.integer else 'a number'}, not {v!r}")
        if not is_finite_number(v):
            raise ParamError(f"{name} must be a finite number, not {v!r}")
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            raise ParamError(f"{name} must be {'>' if self.lo_open else '>='} {self.lo}, not {v!r}")
        if self.hi is not None and v > self.hi:
            raise ParamError(f"{name} must be <= {self.hi}, not {v!r}")
        return v

    @property
    def schema(self) -> dict[str, Any]:  # type: ignore[override]
        out: dict[str, Any] = {"type": "integer" if self.integer else "number"}
        if self.lo is not None:
            out["minimum"] = self.lo
            if self.lo_open:
                out["exclusiveMinimum"] = True
        if self.hi is not None:
            out["maximum"] = self.hi
        return out


class Duration(Check):
    """A duration: "90s", "10m", "7d", or a number of seconds."""

    schema = {"oneOf": [{"type": "string", "pattern": PATTERN, "description": SCHEMA_NOTE},
                        {"type": "number", "minimum": 0, "maximum": MAX_SECONDS}]}

    def __call__(self, name: str, v: Any) -> float:
        try:
            return parse_duration(v)
        except ValueError as exc:
            raise ParamError(f"{name}: {exc}") from None


class Timeout(Duration):
    """A duration longer than zero and at most an hour (how long the service waits on others)."""

    # In one unit, so that the pattern admits exactly what the check does: 1 to 3600 s, 1 to 60 m, or 1 h.
    schema = {"oneOf": [{"type": "string",
                         "pattern": r"^(?:(?:[1-9]\d{0,2}|[12]\d{3}|3[0-5]\d{2}|3600)s|(?:[1-9]|[1-5]\d|60)m|1h)$"},
                        {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 3600}]}

    def __call__(self, name: str, v: Any) -> float:
        seconds = super().__call__(name, v)
        if not 0 < seconds <= 3600:
            raise ParamError(f"{name} must be longer than zero and at most 1h, not {v!r}")
        return seconds


class Patterns(Check):
    """A non-empty list of glob patterns, each naming an entry (never a path)."""

    schema = {"type": "array", "minItems": 1, "maxItems": 64,
              "items": {"type": "string", "minLength": 1, "maxLength": 128, "pattern": "^(?!\\.\\.?$)[^/]+$"}}

    def __call__(self, name: str, v: Any) -> tuple[str, ...]:
        if not isinstance(v, (list, tuple)) or not v or not all(isinstance(p, str) and p for p in v):
            raise ParamError(f"{name} must be a non-empty list of glob patterns")
        if len(v) > 64 or any(len(p) > 128 for p in v):
            raise ParamError(f"{name} takes at most 64 patterns of at most 128 characters each")
        for p in v:
            if "/" in p or p in (".", ".."):
                raise ParamError(f"{name}: pattern {p!r} must name an entry, not a path")
        return tuple(v)


class Reason(Check):
    """Text for people: one line of at most MAX_REASON characters."""

    schema = {"type": "string", "maxLength": MAX_REASON, "pattern": "^[^\\x00-\\x1f\\x7f]*$"}

    def __call__(self, name: str, v: Any) -> str:
        if not isinstance(v, str):
            raise ParamError(f"{name} must be text, not {v!r}")
        if len(v) > MAX_REASON or _CONTROL.search(v):
            raise ParamError(f"{name} must be at most {MAX_REASON} characters on one line")
        return v


def _number(lo: float | None = None, hi: float | None = None, lo_open: bool = False,
            integer: bool = False) -> Number:
    return Number(lo, hi, lo_open, integer)


_duration, _patterns, _reason = Duration(), Patterns(), Reason()


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
class ReduceDataloaderWorkers:
    factor: float = 0.5
    min: int = 1


@dataclass(frozen=True)
class GradientAccumulation:
    steps: int = 2


@dataclass(frozen=True)
class CheckpointJobs:
    timeout: float = 120.0


@dataclass(frozen=True)
class DrainNode:
    reason: str = ""


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
    protect: tuple[str, ...] = ()
    max_bytes: int | None = None

    @property
    def protected(self) -> tuple[str, ...]:
        """The defaults and the playbook's own `protect` patterns."""
        return DEFAULT_PROTECT + tuple(p for p in self.protect if p not in DEFAULT_PROTECT)


@dataclass(frozen=True)
class ActionSpec:
    """What one action is: the kind of target it runs on, how to check its params, and what it means."""

    name: str
    kind: str
    params_type: type
    checks: dict[str, Check]
    # A restore_* / resume_* action undoes another: it belongs in on_resolved, never in an escalation.
    undoes: bool = False
    # scale_lr / set_lr: kept in the job's ledger and applied again after a resume (README: Guarantees, 5).
    sticky: bool = False
    # checkpoint_jobs: carried out by the service itself, never sent to the target's mailbox.
    by_service: bool = False

    def parse(self, params: Any) -> Any:
        """Typed params from a playbook's mapping; raises ParamError naming the allowed keys."""
        values, problems = self._checked(params)
        if problems:
            raise ParamError(problems[0][1])
        return self.params_type(**values)

    def problems(self, params: Any) -> list[tuple[Any, str]]:
        """Every problem of a parameter mapping, each with the key it is about (None: the mapping as a whole)."""
        return self._checked(params)[1]

    def _checked(self, params: Any) -> tuple[dict[str, Any], list[tuple[Any, str]]]:
        """The checked values, and every problem: unknown keys first, then bad values, then what is missing."""
        if params is None:
            params = {}
        if not isinstance(params, dict):
            return {}, [(None, f"parameters of {self.name} must be a mapping")]
        allowed = {f.name: f for f in fields(self.params_type)}
        unknown: list[tuple[Any, str]] = []
        bad: list[tuple[Any, str]] = []
        values: dict[str, Any] = {}
        meant: set[str] = set()
        for key, v in params.items():
            if key not in allowed:
                names = ", ".join(allowed) if allowed else "none"
                close = difflib.get_close_matches(str(key), list(allowed), n=1)
                meant.update(close)
                hint = f"did you mean {close[0]}? " if close else ""
                unknown.append((key, f"{self.name} has no parameter {key!r} ({hint}allowed: {names})"))
                continue
            try:
                values[key] = self.checks[key](key, v)
            except ParamError as exc:
                bad.append((key, str(exc)))
        missing: list[tuple[Any, str]] = [(None, f"{self.name} needs parameter {name!r}")
                                          for name, f in allowed.items()
                                          if name not in params and name not in meant and f.default is MISSING]
        problems = unknown + bad + missing
        if not problems and self.params_type is PowerLimit and (values.get("watts") is None) == (
                values.get("fraction") is None):
            problems.append((None, "power_limit needs exactly one of 'watts' or 'fraction'"))
        return values, problems

    @property
    def needs_params(self) -> bool:
        """Whether an empty parameter mapping is refused (a required parameter, or power_limit's one of two)."""
        return self.params_type is PowerLimit or any(f.default is MISSING for f in fields(self.params_type))

    def params_schema(self) -> dict[str, Any]:
        """The JSON Schema of this action's parameters (what parse() accepts)."""
        props = {k: dict(c.schema) for k, c in self.checks.items()}
        if self.params_type is PowerLimit:
            # Exactly one of watts or fraction (with an optional floor either way).
            return {"oneOf": [{"type": "object", "additionalProperties": False, "required": [one],
                               "properties": {one: props[one], "floor_watts": props["floor_watts"]}}
                              for one in ("watts", "fraction")]}
        required = [f.name for f in fields(self.params_type) if f.default is MISSING]
        out: dict[str, Any] = {"type": "object", "additionalProperties": False, "properties": props}
        if required:
            out["required"] = required
        return out


def _spec(name: str, kind: str, ptype: type, *, undoes: bool = False, sticky: bool = False,
          by_service: bool = False, **checks: Check) -> ActionSpec:
    return ActionSpec(name, kind, ptype, checks, undoes, sticky, by_service)


CATALOGUE: dict[str, ActionSpec] = {s.name: s for s in (
    _spec("scale_lr", "job", ScaleLR, sticky=True, factor=_number(0, 10, lo_open=True), min_lr=_number(0)),
    _spec("set_lr", "job", SetLR, sticky=True, lr=_number(0, lo_open=True)),
    _spec("empty_cache", "job", NoParams),
    _spec("reduce_batch_size", "job", ReduceBatchSize,
          factor=_number(0, 1, lo_open=True), min=_number(1, integer=True)),
    _spec("reduce_dataloader_workers", "job", ReduceDataloaderWorkers,
          factor=_number(0, 1, lo_open=True), min=_number(0, integer=True)),
    _spec("enable_gradient_accumulation", "job", GradientAccumulation, steps=_number(2, 1024, integer=True)),
    _spec("rollback_checkpoint", "job", NoParams),
    _spec("save_checkpoint", "job", NoParams),
    _spec("stop_training", "job", NoParams),
    _spec("power_limit", "node", PowerLimit, watts=_number(1), fraction=_number(0, 1, lo_open=True),
          floor_watts=_number(1)),
    _spec("restore_power_limit", "node", NoParams, undoes=True),
    _spec("disk_cleanup", "node", DiskCleanup, keep_last=_number(0, integer=True), older_than=_duration,
          patterns=_patterns, protect=_patterns, max_bytes=_number(1, integer=True)),
    _spec("drain_node", "node", DrainNode, reason=_reason),
    _spec("resume_node", "node", NoParams, undoes=True),
    _spec("requeue_jobs", "node", NoParams),
    _spec("checkpoint_jobs", "node", CheckpointJobs, by_service=True, timeout=Timeout()),
)}
# Actions the service carries out itself: a record that has one is sent by the reconciler, step by step.
BY_SERVICE = frozenset(name for name, spec in CATALOGUE.items() if spec.by_service)
