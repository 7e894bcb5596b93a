"""Records that only repeat a remediation, folded into one line under it, so real remediations stay in view.

An alert that keeps firing within its playbook's cooldown (a detector raising it again and again, Alertmanager
notifying new episodes of a flapping alert) makes a `skipped` / `cooldown` record each time; so does a record
skipped for an episode that an older record of the same playbook and target already answered. The pages show
each such repeat under the nearest older record of its playbook and target that is not a repeat itself, as one
line that opens to the list; repeats whose remediation is on an older page make one line of their own, where
the newest of them would have been.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...client.wire.status import Reason, RecordStatus


@dataclass(frozen=True)
class Row:
    """One line of a page's records: a record (None: repeats whose remediation is not on this page) and the
    repeats folded under it, newest first."""

    rec: dict[str, Any] | None
    repeats: tuple[dict[str, Any], ...] = ()

    @property
    def first(self) -> dict[str, Any]:
        """The record the line is about: its own, else its newest repeat's."""
        return self.rec if self.rec is not None else self.repeats[0]


def _key(rec: dict[str, Any]) -> tuple[str, str, str]:
    t = rec.get("target") or {}
    return str(rec.get("playbook")), str(t.get("kind")), str(t.get("name"))


def _episode(rec: dict[str, Any]) -> tuple[str, str]:
    alert = rec.get("alert") or {}
    return str(alert.get("fingerprint")), str(alert.get("starts_at"))[:19]  # startsAt to the second


def repeats(items: list[dict[str, Any]]) -> list[bool]:
    """For records newest first: whether each only repeats an older one (a cooldown skip, or a skipped record of
    an episode that an older record of the same playbook and target had)."""
    seen: set[tuple[tuple[str, str, str], tuple[str, str]]] = set()
    out = [False] * len(items)
    for i in range(len(items) - 1, -1, -1):  # oldest first
        rec = items[i]
        episode = (_key(rec), _episode(rec))
        out[i] = rec.get("status") == RecordStatus.SKIPPED and (
            rec.get("reason") == Reason.COOLDOWN or episode in seen)
        seen.add(episode)
    return out


def fold(items: list[dict[str, Any]]) -> list[Row]:
    """The page's lines for records newest first: each repeat folded under the record it repeats."""
    repeat = repeats(items)
    under: dict[int, list[dict[str, Any]]] = {}  # a record's index -> the repeats folded under it
    orphans: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    nearest_older: dict[tuple[str, str, str], int] = {}
    for i in range(len(items) - 1, -1, -1):
        key = _key(items[i])
        if not repeat[i]:
            nearest_older[key] = i
        elif key in nearest_older:
            under.setdefault(nearest_older[key], []).insert(0, items[i])
        else:
            orphans.setdefault(key, []).insert(0, items[i])
    rows: list[Row] = []
    for i, rec in enumerate(items):
        if not repeat[i]:
            rows.append(Row(rec, tuple(under.get(i, ()))))
        elif (found := orphans.get(_key(rec))) and found[0] is rec:  # the newest orphan holds its line
            rows.append(Row(None, tuple(found)))
    return rows
