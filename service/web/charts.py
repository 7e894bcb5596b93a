"""Inline SVG charts for the history page: a target's remediations over time and its LR before and after."""
from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, UTC
from typing import Any
from collections.abc import Iterable, Sequence

from ...client.wire.protocol import parse_rfc3339
from ...client.wire.status import ActionStatus

LR_ACTIONS = ("scale_lr", "set_lr")
DOT_R = 7
_FAN = (0, -1, 1, -2, 2)  # vertical offsets, in dot sizes, of dots that would cover each other in a lane
# Tick spacings to choose from, in seconds: the first that gives at most ~7 ticks wins.
_STEPS = (10, 30, 60, 300, 900, 1800, 3600, 3 * 3600, 6 * 3600, 12 * 3600, 86400, 2 * 86400, 7 * 86400, 30 * 86400)


# Seconds since the epoch of an RFC 3339 time, or None (the pages read record times with it).
parse_time = parse_rfc3339


@dataclass(frozen=True)
class Tick:
    """A labelled position on an axis."""

    pos: float
    label: str


@dataclass(frozen=True)
class Dot:
    """One remediation on the timeline."""

    x: float
    y: float
    status: str
    title: str
    anchor: str


@dataclass(frozen=True)
class Lane:
    """One playbook's row on the timeline."""

    y: float
    label: str


@dataclass(frozen=True)
class Frame:
    """The plot area inside an SVG of width x height."""

    width: int = 900
    height: int = 200
    left: int = 150
    right: int = 20
    top: int = 16
    bottom: int = 28

    @property
    def x1(self) -> int:
        return self.width - self.right

    @property
    def y1(self) -> int:
        return self.height - self.bottom


@dataclass(frozen=True)
class Timeline:
    """Remediations of one target over time, one lane per playbook."""

    frame: Frame
    lanes: tuple[Lane, ...]
    dots: tuple[Dot, ...]
    ticks: tuple[Tick, ...]


@dataclass(frozen=True)
class LrChange:
    """One LR action's effect as its ack reported it."""

    at: float
    action: str
    before: tuple[float, ...]
    after: tuple[float, ...]
    step: int | None
    record_id: str


@dataclass(frozen=True)
class LrChart:
    """Group 0's LR over time: a step down (or up) at each LR action."""

    frame: Frame
    path: str
    befores: tuple[tuple[float, float], ...]
    afters: tuple[tuple[float, float], ...]
    xticks: tuple[Tick, ...]
    yticks: tuple[Tick, ...]
    log_scale: bool


def _time_axis(t0: float, t1: float, frame: Frame) -> tuple[float, float, tuple[Tick, ...]]:
    """A padded time span and its ticks at a readable spacing."""
    span = max(t1 - t0, 300.0)
    if t1 - t0 < span:  # a burst shows as a burst, not as dots spread over the width
        t0 = t1 - span
    t0, t1 = t0 - span * 0.04, t1 + span * 0.04
    return t0, t1, time_ticks(t0, t1, frame)


def time_ticks(t0: float, t1: float, frame: Frame) -> tuple[Tick, ...]:
    """Ticks of an exact time span at a readable spacing (at most about seven)."""
    step = next((s for s in _STEPS if (t1 - t0) / s <= 7), _STEPS[-1])
    fmt = "%H:%M:%S" if step < 60 else "%H:%M" if t1 - t0 < 86400 else "%b %d %H:%M" if t1 - t0 < 7 * 86400 else "%b %d"
    ticks = []
    t = math.ceil(t0 / step) * step
    while t <= t1:
        x = frame.left + (t - t0) / (t1 - t0) * (frame.x1 - frame.left)
        ticks.append(Tick(round(x, 1), datetime.fromtimestamp(t, tz=UTC).strftime(fmt)))
        t += step
    return tuple(ticks)


def x_of(t: float, t0: float, t1: float, frame: Frame) -> float:
    return round(frame.left + (t - t0) / (t1 - t0) * (frame.x1 - frame.left), 1)


def _minute(now: float) -> float:
    # Charts run up to the next whole minute, not to the second: a refresh redraws only when something changed.
    return math.ceil(now / 60) * 60


def timeline(records: Sequence[dict], now: float) -> Timeline | None:
    """The timeline of records (any order), or None when there are none with a time."""
    now = _minute(now)
    timed = [(parse_time(r.get("created_at")), r) for r in records]
    known: list[tuple[float, dict[str, Any]]] = [(t, r) for t, r in timed if t is not None]
    if not known:
        return None
    playbooks = sorted({r["playbook"] for _, r in known})
    frame = Frame(height=max(100, 44 + 44 * len(playbooks)))
    lane_h = (frame.y1 - frame.top) / len(playbooks)
    lanes = tuple(Lane(round(frame.top + lane_h * (i + 0.5), 1), p) for i, p in enumerate(playbooks))
    ys = {lane.label: lane.y for lane in lanes}
    t0, t1, ticks = _time_axis(min(t for t, _ in known), max(now, max(t for t, _ in known)), frame)
    dots = []
    last: dict[str, tuple[float, int]] = {}  # lane -> (x of the previous dot, how many overlap there)
    for t, r in sorted(known, key=lambda tr: tr[0]):
        x, lane = x_of(t, t0, t1, frame), r["playbook"]
        px, k = last.get(lane, (-1e9, 0))
        # A burst (records seconds apart) would draw one dot on another: fan them out up and down.
        k = k + 1 if x - px < 2 * DOT_R else 0
        last[lane] = (x if k == 0 else px, k)
        dy = _FAN[k % len(_FAN)] * (DOT_R + 1)
        dots.append(Dot(x, round(ys[lane] + dy, 1), r["status"],
                        f"{r['created_at']} · {r['playbook']} · {r['status'].replace('_', ' ')}", "rec-" + r["id"]))
    return Timeline(frame, lanes, tuple(dots), ticks)


def floats(value: object) -> tuple[float, ...] | None:
    """A non-empty list of finite numbers as a tuple, else None (LRs from results and heartbeats)."""
    if not isinstance(value, list) or not value:
        return None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value):
        return None
    return tuple(float(v) for v in value)


def lr_changes(records: Iterable[dict]) -> list[LrChange]:
    """Every applied LR action with old_lr/new_lr in its ack result, oldest first."""
    out = []
    for rec in records:
        for a in rec.get("actions", ()):
            result = a.get("result")
            if (a.get("action") not in LR_ACTIONS or a.get("status") != ActionStatus.APPLIED
                    or not isinstance(result, dict)):
                continue
            before, after = floats(result.get("old_lr")), floats(result.get("new_lr"))
            at = parse_time(a.get("acked_at")) or parse_time(rec.get("created_at"))
            if before is None or after is None or at is None:
                continue
            step = result.get("step")
            out.append(LrChange(at, a["action"], before, after, step if isinstance(step, int) else None,
                                rec["id"]))
    out.sort(key=lambda c: c.at)
    return out


def lr_chart(changes: Sequence[LrChange], now: float, current: Sequence[float] | None = None) -> LrChart | None:
    """Group 0's LR through the changes (and up to now, from the live heartbeat when known)."""
    if not changes:
        return None
    now = _minute(now)
    frame = Frame(height=220, left=80)
    points: list[tuple[float, float]] = []
    for c in changes:
        points += [(c.at, c.before[0]), (c.at, c.after[0])]
    end_lr = current[0] if current else changes[-1].after[0]
    points.append((max(now, changes[-1].at), end_lr))
    values = [v for _, v in points]
    log_scale = min(values) > 0
    f = math.log10 if log_scale else float
    lo, hi = f(min(values)), f(max(values))
    pad = (hi - lo) * 0.15 or (0.1 if log_scale else abs(hi) * 0.1 or 1.0)
    lo, hi = lo - pad, hi + pad

    def y(v: float) -> float:
        return round(frame.y1 - (f(v) - lo) / (hi - lo) * (frame.y1 - frame.top), 1)

    t0, t1, xticks = _time_axis(points[0][0], points[-1][0], frame)
    path = " ".join(("M" if i == 0 else "L") + f"{x_of(t, t0, t1, frame)},{y(v)}" for i, (t, v) in enumerate(points))
    yticks: list[Tick] = []
    for v in sorted(set(values), reverse=True):
        if not yticks or y(v) - yticks[-1].pos >= 14:  # labels closer than a line of text would overlap
            yticks.append(Tick(y(v), f"{v:.3g}"))
    return LrChart(frame, path,
                   tuple((x_of(c.at, t0, t1, frame), y(c.before[0])) for c in changes),
                   tuple((x_of(c.at, t0, t1, frame), y(c.after[0])) for c in changes),
                   xticks, tuple(yticks), log_scale)
