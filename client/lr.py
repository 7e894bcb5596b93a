"""Scheduler-safe learning-rate changes: scale every quantity a scheduler recomputes the LR from."""
from __future__ import annotations

from typing import Any, Iterable, Sequence

# Per-group list attributes that schedulers derive the LR from (LRScheduler, CyclicLR, ReduceLROnPlateau).
_LIST_ATTRS = ("base_lrs", "max_lrs", "min_lrs", "_last_lr")
# Param-group keys that schedulers derive the LR from (LRScheduler, OneCycleLR).
_GROUP_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")


def schedulers_of(scheduler: Any) -> list[Any]:
    """The scheduler and every child of SequentialLR / ChainedScheduler, each once."""
    out: list[Any] = []
    seen: set[int] = set()
    stack = [scheduler] if scheduler is not None else []
    while stack:
        s = stack.pop()
        if id(s) in seen:
            continue
        seen.add(id(s))
        out.append(s)
        stack.extend(getattr(s, "_schedulers", None) or [])
    return out


def current_lrs(optimizer: Any) -> list[float]:
    return [float(g["lr"]) for g in optimizer.param_groups]


def _rescale(optimizer: Any, scheduler: Any, factors: Sequence[float]) -> None:
    """Multiply group i's LR and every scheduler quantity behind it by factors[i]."""
    for g, f in zip(optimizer.param_groups, factors):
        for k in _GROUP_KEYS:
            if isinstance(g.get(k), (int, float)) and not isinstance(g.get(k), bool):
                g[k] = g[k] * f
    uniform = factors[0] if factors and all(f == factors[0] for f in factors) else None
    for s in schedulers_of(scheduler):
        for attr in _LIST_ATTRS:
            vals = getattr(s, attr, None)
            if isinstance(vals, list) and len(vals) == len(factors):
                setattr(s, attr, [v * f if isinstance(v, (int, float)) else v for v, f in zip(vals, factors)])
        # eta_min is one number for all groups (CosineAnnealing*): exact when the factors agree.
        if isinstance(getattr(s, "eta_min", None), (int, float)):
            if uniform is not None:
                s.eta_min = s.eta_min * uniform
            else:
                s.eta_min = s.eta_min * min(factors)


def scale_lr(optimizer: Any, scheduler: Any, factor: float, min_lr: float = 0.0) -> dict:
    """Every group's LR times factor, floored at min_lr, kept through the scheduler's later steps."""
    old = current_lrs(optimizer)
    factors = []
    for lr in old:
        f = factor
        if lr > 0 and lr * factor < min_lr:
            # Floor: shrink no further than min_lr (never raise an LR that was already lower).
            f = min(1.0, min_lr / lr) if factor <= 1 else factor
        factors.append(f)
    _rescale(optimizer, scheduler, factors)
    return {"old_lr": old, "new_lr": current_lrs(optimizer), "factors": factors}


def set_lr(optimizer: Any, scheduler: Any, lr: float) -> dict:
    """Every group's LR set to lr; the scheduler's schedule is rescaled to go on from there."""
    old = current_lrs(optimizer)
    factors = []
    bases = [None] * len(old)
    sched = schedulers_of(scheduler)
    if sched and isinstance(getattr(sched[0], "base_lrs", None), list):
        bases = sched[0].base_lrs
    for cur, base in zip(old, bases):
        ref = cur if cur > 0 else (base or 0.0)
        factors.append(lr / ref if ref > 0 else 1.0)
    _rescale(optimizer, scheduler, factors)
    for g in optimizer.param_groups:  # exact value, whatever rounding the scaling left
        if g["lr"] > 0:
            g["lr"] = lr
    return {"old_lr": old, "new_lr": current_lrs(optimizer), "factors": factors}
