"""The metric around a remediation, drawn server-side as SVG: the alert's expression from Prometheus over a
bounded window, a marker for each action, stage and the resolve, and below it the job's LR or the node's
power limit as the acks reported them. Prometheus's answer is cached in Redis per record; a slow or absent
Prometheus leaves the page fast, with a note instead of the chart."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any
from collections.abc import Iterable, Sequence

from ...client.wire import keys
from ...client.wire.status import ActionStatus

from ..prometheus import Prometheus, PrometheusError, Series, decode, encode, expr_of, split_comparison
from .chart_markers import KEY_R, Marked, events as marker_events, marked
from .charts import Frame, Tick, floats, lr_changes, parse_time, time_ticks, x_of

MAX_SPAN = 6 * 3600.0
POINTS = 240
# A window that reaches into the present is asked again after this long; one wholly past, after a day.
FRESH_TTL = 30
PAST_TTL = 86400
# After a failed query the page shows its note this long before asking Prometheus again.
FAILED_TTL = 30
POWER_ACTIONS = ("power_limit", "restore_power_limit")


@dataclass(frozen=True)
class Line:
    """One series as an SVG path."""

    path: str
    name: str
    index: int
    dashed: bool = False  # the alert's threshold


@dataclass(frozen=True)
class Plot:
    """One chart: lines, axes and markers in a frame."""

    frame: Frame
    lines: tuple[Line, ...]
    xticks: tuple[Tick, ...]
    yticks: tuple[Tick, ...]
    marked: Marked
    title: str


@dataclass(frozen=True)
class Around:
    """What a page shows around one remediation."""

    record_id: str
    expr: str | None
    metric: Plot | None
    note: str | None
    below: Plot | None
    shown: int = 0
    total: int = 0


def window(anchor: dict[str, Any], ladder: Sequence[dict[str, Any]], now: float) -> tuple[float, float]:
    """From a little before the alert fired to a little after its ladder's last event (or now, while it goes
    on): padded by a sixth of that span, a minute at least, and at most MAX_SPAN long."""
    created = parse_time(anchor.get("created_at")) or now
    started = parse_time((anchor.get("alert") or {}).get("starts_at")) or created
    events = [created, *(e[0] for e in marker_events(ladder))]
    first = max(min(started, *events), created - MAX_SPAN / 2)
    over = any((r.get("outcome") or {}).get("resolved_at") for r in ladder)
    end = max(events) if over else now
    pad = max(60.0, (end - first) / 6)
    t0, t1 = first - pad, min(now, end + pad)
    if t1 - t0 > MAX_SPAN:
        t1 = t0 + MAX_SPAN
    return t0, max(t1, t0 + 120)


def _nice_ticks(lo: float, hi: float) -> list[float]:
    """About five round values from lo to hi."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / 4
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def plot(series: Sequence[tuple[str, Sequence[tuple[float, float]]]], t0: float, t1: float, title: str,
         markers_for: Any = None, height: int = 240, dashed: int = 0) -> Plot | None:
    """Lines for (name, points) pairs over [t0, t1], the last `dashed` of them dashed (thresholds); None when
    no point falls in the window."""
    frame = Frame(height=height, left=80, top=2 * KEY_R + 6)  # room above the plot for the markers' keys
    values = [v for _, pts in series for t, v in pts if t0 <= t <= t1]
    if not values:
        return None
    lo, hi = min(values), max(values)
    pad = (hi - lo) * 0.1 or abs(hi) * 0.1 or 1.0
    lo, hi = lo - pad, hi + pad

    def y(v: float) -> float:
        return round(frame.y1 - (v - lo) / (hi - lo) * (frame.y1 - frame.top), 1)

    lines = []
    for i, (name, pts) in enumerate(series):
        inside = [(t, v) for t, v in pts if t0 <= t <= t1]
        if inside:
            path = " ".join(("M" if j == 0 else "L") + f"{x_of(t, t0, t1, frame)},{y(v)}"
                            for j, (t, v) in enumerate(inside))
            lines.append(Line(path, name, i, i >= len(series) - dashed))
    yticks = tuple(Tick(y(v), f"{v:.4g}") for v in _nice_ticks(lo, hi))
    marks = markers_for(t0, t1, frame) if markers_for else Marked()
    return Plot(frame, tuple(lines), time_ticks(t0, t1, frame), yticks, marks, title)


def steps(changes: Iterable[tuple[float, float, float]], t1: float) -> list[tuple[float, float]]:
    """A step line through (time, before, after) changes, held until t1."""
    pts: list[tuple[float, float]] = []
    for t, before, after in sorted(changes):
        pts += [(t, before), (t, after)]
    if pts:
        pts.append((max(t1, pts[-1][0]), pts[-1][1]))
    return pts


def below(kind: str, records: Sequence[dict[str, Any]], t0: float, t1: float,
          markers_for: Any) -> Plot | None:
    """A job's LR (param group 0) or a node's power limit per GPU, as the acks reported them."""
    if kind == "job":
        lr = [(c.at, c.before[0], c.after[0]) for c in lr_changes(records)]
        return plot([("learning rate", steps(lr, t1))], t0, t1, "learning rate (param group 0)", markers_for, 160)
    per_gpu: dict[str, list[tuple[float, float, float]]] = {}
    for rec in records:
        for a in rec.get("actions") or ():
            res = a.get("result")
            at = parse_time(a.get("acked_at"))
            if (a.get("action") not in POWER_ACTIONS or a.get("status") != ActionStatus.APPLIED
                    or not isinstance(res, dict)):
                continue
            vals = floats([res.get("old_watts"), res.get("new_watts")])
            if at is None or vals is None:
                continue
            gpu = res.get("gpu")
            gpu = gpu if isinstance(gpu, dict) else {}
            per_gpu.setdefault(f"GPU {gpu.get('index', '?')}", []).append((at, vals[0], vals[1]))
    return plot([(name, steps(ch, t1)) for name, ch in sorted(per_gpu.items())], t0, t1, "power limit (W)",
                markers_for, 160)


def around(r: Any, prom: Prometheus | None, anchor: dict[str, Any], records: Sequence[dict[str, Any]],
           now: float) -> Around:
    """The chart around `anchor` (a record), with the markers of `records` (its ladder, or the target's)."""
    rid = anchor["id"]
    expr = expr_of((anchor.get("alert") or {}).get("generator_url"))
    t0, t1 = window(anchor, [r_ for r_ in records if r_["id"] == rid or _same_ladder(r_, anchor)], now)
    kind = (anchor.get("target") or {}).get("kind") or "job"

    def markers_for(a: float, b: float, frame: Frame) -> Marked:
        return marked(anchor, records, a, b, frame)

    lower = below(kind, records, t0, t1, markers_for)
    if prom is None:
        return Around(rid, expr, None, "Set TRAINMEDIC_PROMETHEUS_URL to see the alert's metric around each "
                                       "remediation.", lower)
    if expr is None:
        return Around(rid, None, None, "The alert carries no expression (its generatorURL has no g0.expr).", lower)
    # A comparison alone would show only while the alert fires: draw its value side and, dashed, its threshold.
    cmp = split_comparison(expr)
    queries = [expr] if cmp is None else [cmp.value] + ([cmp.threshold] if cmp.constant is None else [])
    try:
        answers = _cached_ranges(r, prom, anchor, queries, t0, t1, now)
    except PrometheusError as exc:
        return Around(rid, expr, None, f"No chart: {exc}.", lower)
    labels = (anchor.get("alert") or {}).get("labels") or {}
    series, total = answers[0]
    lines = [(x.name, x.points) for x in _this_alert(series, labels)]
    thresholds: list[tuple[str, Sequence[tuple[float, float]]]] = []
    if cmp is not None and cmp.constant is not None:
        thresholds = [(f"threshold ({cmp.op} {cmp.constant:g})", ((t0, cmp.constant), (t1, cmp.constant)))]
    elif cmp is not None:
        thresholds = [(f"threshold: {x.name}", x.points) for x in _this_alert(answers[1][0], labels)]
    metric = plot(lines + thresholds, t0, t1, expr, markers_for, dashed=len(thresholds)) if lines else None
    note = None if metric else "Prometheus has no samples of the alert's expression in this window."
    return Around(rid, expr, metric, note, lower, len(lines), total)


def _this_alert(series: list[Series], labels: dict[str, str]) -> list[Series]:
    """The expression gives every series of the rule; this alert's are those whose labels it carries."""
    mine = [x for x in series if all(labels.get(k) == v for k, v in x.labels.items() if k != "__name__")]
    return mine or series


def _same_ladder(rec: dict[str, Any], anchor: dict[str, Any]) -> bool:
    first = (anchor.get("escalation") or {}).get("parent") or anchor["id"]
    return rec["id"] == first or (rec.get("escalation") or {}).get("parent") == first


def _cached_ranges(r: Any, prom: Prometheus, anchor: dict[str, Any], exprs: list[str], t0: float, t1: float,
                   now: float) -> list[tuple[list[Series], int]]:
    """Each query's range answer, from the record's cache entry when Prometheus was asked lately."""
    key = keys.chart_cache(keys.target_of_record(anchor["id"]), anchor["id"])
    cached = r.get(key)
    if cached:
        if cached.startswith("!"):
            raise PrometheusError(cached[1:])
        return decode(cached)
    try:
        answers = [prom.query_range(e, t0, t1, (t1 - t0) / POINTS) for e in exprs]
    except PrometheusError as exc:
        r.set(key, "!" + str(exc), ex=FAILED_TTL)
        raise
    r.set(key, encode(answers), ex=FRESH_TTL if t1 >= now - 60 else PAST_TTL)
    return answers
