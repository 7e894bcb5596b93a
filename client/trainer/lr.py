"""Scheduler-safe learning-rate changes: scale every quantity a scheduler recomputes the LR from."""
from __future__ import annotations

from typing import Any
from collections.abc import Iterable, Sequence

# Per-group lists that schedulers derive the LR from: LRScheduler.base_lrs (LambdaLR, StepLR, the
# closed forms behind step(epoch), SequentialLR milestones), CyclicLR.max_lrs, and _last_lr so
# get_last_lr() tells the truth right after the change.
_LIST_ATTRS = ("base_lrs", "max_lrs", "_last_lr")
# Param-group keys: initial_lr (a scheduler rebuilt on resume takes base_lrs from it; SequentialLR
# resets to it), and OneCycleLR's initial_lr/max_lr/min_lr, which it interpolates between every step.
_GROUP_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")
# One number for every group that shapes the schedule (CosineAnnealingLR / WarmRestarts eta_min).
_SCALAR_ATTRS = ("eta_min",)
# A scheduler's own floors (ReduceLROnPlateau.min_lrs): the user's, never lowered, and never crossed by a
# scale_lr either (its min_lr is a floor too).


def optimizers_of(optimizer: Any) -> list[Any]:
    """The optimizers behind one optimizer, a list of them, or wrappers such as accelerate's."""
    items = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    out = []
    for o in items:
        if o is None:
            continue
        # accelerate's AcceleratedOptimizer and Lightning's LightningOptimizer hold the real one.
        inner = getattr(o, "optimizer", None) or getattr(o, "_optimizer", None)
        out.append(inner if inner is not None and hasattr(inner, "param_groups") else o)
    return out


def _unwrap_scheduler(s: Any) -> Any:
    # accelerate's AcceleratedScheduler and Lightning's LRSchedulerConfig keep the real one in .scheduler.
    for _ in range(4):
        inner = getattr(s, "scheduler", None)
        if inner is None or inner is s:
            break
        s = inner
    return s


def schedulers_of(scheduler: Any) -> list[Any]:
    """Every scheduler given (one, a list, or wrappers) and each child of SequentialLR / ChainedScheduler, once."""
    roots = list(scheduler) if isinstance(scheduler, (list, tuple)) else [scheduler]
    out: list[Any] = []
    seen: set[int] = set()
    stack = [_unwrap_scheduler(s) for s in reversed(roots) if s is not None]
    while stack:
        s = stack.pop()
        if id(s) in seen:
            continue
        seen.add(id(s))
        out.append(s)
        stack.extend(reversed(list(getattr(s, "_schedulers", None) or [])))
    return out


def current_lrs(optimizer: Any) -> list[float]:
    """Every param group's LR, over all optimizers given, in order."""
    return [float(g["lr"]) for o in optimizers_of(optimizer) for g in o.param_groups]


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _times(v: Any, f: float) -> Any:
    if _is_number(v):
        return v * f
    if hasattr(v, "mul_") and hasattr(v, "dim") and v.dim() == 0:
        return v * f  # a tensor LR (capturable optimizers): a new tensor, like the scheduler's own lists
    return v


def _scale_group(group: dict[str, Any], f: float) -> None:
    for k in _GROUP_KEYS:
        v: Any = group.get(k)
        if _is_number(v):
            group[k] = v * f
        elif hasattr(v, "mul_") and hasattr(v, "dim") and v.dim() == 0:
            v.mul_(f)  # in place: compiled / capturable steps hold on to this very tensor


def _owner(s: Any, opts: Sequence[Any]) -> Any:
    groups = getattr(getattr(s, "optimizer", None), "param_groups", None)
    for o in opts:
        if groups is not None and groups is o.param_groups:
            return o
    return opts[0] if len(opts) == 1 else None


def _rescale(opts: Sequence[Any], scheds: Iterable[Any], factors: Sequence[Sequence[float]]) -> None:
    """Multiply group i of optimizer k, and every scheduler quantity behind it, by factors[k][i]."""
    for o, fs in zip(opts, factors):
        for g, f in zip(o.param_groups, fs):
            _scale_group(g, f)
    for s in scheds:
        owner = _owner(s, opts)
        if owner is None:
            continue
        fs = list(factors[list(opts).index(owner)])
        for attr in _LIST_ATTRS:
            vals = getattr(s, attr, None)
            if isinstance(vals, (list, tuple)) and len(vals) == len(fs):
                # A new list: SequentialLR shares its child's _last_lr list; scaling in place would do it twice.
                setattr(s, attr, type(vals)(_times(v, f) for v, f in zip(vals, fs)))
        for attr in _SCALAR_ATTRS:
            v: Any = getattr(s, attr, None)
            if _is_number(v) and fs:
                # One value for all groups: exact when the factors agree, which they do unless min_lr
                # held some groups back; then the smallest factor keeps eta_min below every group.
                setattr(s, attr, v * min(fs))


def _factor(lr: float, factor: float, min_lr: float) -> float:
    if lr > 0 and factor < 1 and lr * factor < min_lr:
        # Floor: shrink no further than min_lr, and never raise an LR that was already below it.
        return min(1.0, min_lr / lr)
    return factor


def _floors(o: Any, scheds: Sequence[Any], min_lr: float) -> list[float]:
    """Per group of optimizer o: the higher of min_lr and its schedulers' own floors (min_lrs)."""
    floors = [min_lr] * len(o.param_groups)
    for s in scheds:
        own = getattr(s, "min_lrs", None)
        if _owner(s, [o]) is o and isinstance(own, (list, tuple)) and len(own) == len(floors):
            floors = [max(f, float(v)) if _is_number(v) else f for f, v in zip(floors, own)]
    return floors


def scale_lr(optimizer: Any, scheduler: Any, factor: float, min_lr: float = 0.0) -> dict[str, Any]:
    """Every group's LR times factor, floored at min_lr (and the scheduler's own floors), kept through the
    scheduler's later steps."""
    opts = optimizers_of(optimizer)
    scheds = schedulers_of(scheduler)
    old = current_lrs(opts)
    factors = [[_factor(float(g["lr"]), factor, floor) for g, floor in zip(o.param_groups, _floors(o, scheds, min_lr))]
               for o in opts]
    _rescale(opts, scheds, factors)
    return {"old_lr": old, "new_lr": current_lrs(opts), "factors": [f for fs in factors for f in fs]}


def set_lr(optimizer: Any, scheduler: Any, lr: float) -> dict[str, Any]:
    """Every group's LR set to lr; the schedule is rescaled to go on from there."""
    opts = optimizers_of(optimizer)
    scheds = schedulers_of(scheduler)
    old = current_lrs(opts)
    factors = []
    for o in opts:
        bases = next((s.base_lrs for s in scheds if _owner(s, [o]) is o and isinstance(getattr(s, "base_lrs", None),
                                                                                   list)), None)
        fs = []
        for i, g in enumerate(o.param_groups):
            cur = float(g["lr"])
            # An LR of 0 (the first warm-up step) has no ratio: scale the schedule's base instead.
            ref = cur if cur > 0 else (float(bases[i]) if bases and i < len(bases) else 0.0)
            fs.append(lr / ref if ref > 0 else 1.0)
        factors.append(fs)
    _rescale(opts, scheds, factors)
    for o in opts:
        for g in o.param_groups:  # the exact value asked for, whatever rounding the scaling left
            if _is_number(g["lr"]) and g["lr"] > 0:
                g["lr"] = lr
    return {"old_lr": old, "new_lr": current_lrs(opts), "factors": [f for fs in factors for f in fs]}
