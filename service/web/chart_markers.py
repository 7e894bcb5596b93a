"""The moments marked on a record's charts: the alert firing, each action applied, each stage, the resolve.

Each moment is a vertical line; moments too close to tell apart (an alert and the actions that answered it
within the same second) share one numbered key at the top of the chart, and the list under the chart says, in
page text that any width keeps readable, what each number stands for. Keys never overlap: two keys are at
least one key's width apart, in the chart's own units, so they stay apart at any width the chart is drawn.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any
from collections.abc import Iterable

from ...client.wire.status import ActionStatus

from .charts import Frame, parse_time, x_of

KEY_R = 9  # a key's radius, in the chart's units
KEY_GAP = 2 * KEY_R + 4  # the least distance between two keys' centres


@dataclass(frozen=True)
class Marker:
    """A vertical line at a moment."""

    x: float
    kind: str  # alert, action, stage, resolve: its colour
    title: str


@dataclass(frozen=True)
class MarkerKey:
    """The numbered key of one or more moments close together, and what each was."""

    number: int
    x: float
    at: str  # the first moment's time, UTC
    words: tuple[tuple[str, str], ...]  # (kind, what happened) in time order


@dataclass(frozen=True)
class Marked:
    """Everything a chart marks: the lines and their keys."""

    lines: tuple[Marker, ...] = ()
    keys: tuple[MarkerKey, ...] = ()


def events(records: Iterable[dict[str, Any]]) -> list[tuple[float, str, str, str]]:
    """(time, kind, words, tooltip) for each ack applied, stage and resolve of the records."""
    out = []
    for rec in records:
        stage = (rec.get("escalation") or {}).get("stage") or 0
        created = parse_time(rec.get("created_at"))
        if stage and created is not None:
            out.append((created, "stage", f"stage {stage}", f"escalation stage {stage} decided"))
        for a in rec.get("actions") or ():
            at = parse_time(a.get("acked_at"))
            if at is not None and a.get("status") == ActionStatus.APPLIED:
                out.append((at, "action", f"{a['action']} applied", f"{a['action']} applied ({rec['playbook']})"))
        resolved = parse_time((rec.get("outcome") or {}).get("resolved_at"))
        if resolved is not None:
            out.append((resolved, "resolve", "resolved", "the alert resolved"))
    return out


def marked(anchor: dict[str, Any], records: Iterable[dict[str, Any]], t0: float, t1: float,
           frame: Frame) -> Marked:
    """The lines and keys of the records' moments within [t0, t1], and the anchor's alert firing."""
    found = events(records)
    started = parse_time((anchor.get("alert") or {}).get("starts_at"))
    if started is not None:
        found.append((started, "alert", "fired", "the alert started firing"))
    lines: list[Marker] = []
    groups: list[tuple[float, float, list[tuple[str, str]]]] = []  # (x, time, words) per key
    seen: set[tuple[str, float]] = set()
    for t, kind, words, title in sorted(found, key=lambda e: e[0]):
        if not t0 <= t <= t1 or (words, round(t, 3)) in seen:
            continue
        seen.add((words, round(t, 3)))
        x = x_of(t, t0, t1, frame)
        lines.append(Marker(x, kind, title))
        if groups and x - groups[-1][0] < KEY_GAP:
            groups[-1][2].append((kind, words))
        else:
            # Kept inside the plot: a key at the very edge would be cut in half.
            groups.append((min(max(x, frame.left + KEY_R), frame.x1 - KEY_R), t, [(kind, words)]))
    keys = tuple(MarkerKey(i, x, time.strftime("%H:%M:%S", time.gmtime(t)), tuple(words))
                 for i, (x, t, words) in enumerate(groups, 1))
    return Marked(tuple(lines), keys)
