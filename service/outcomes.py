"""Outcomes per playbook over time: what GET /playbooks and /metrics show, kept in Redis by the reconciler.

Each record's outcome is noted once per status it reaches (the reconciler marks the record when it notes
it), in sorted sets by time for the 30-day view and in count hashes for the Prometheus counter and
histogram. Every key is bounded: the sets are trimmed to 30 days and a size cap on each write.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any
from collections.abc import Iterable

from ..client.wire import keys
from ..client.wire.status import Outcome, values

WINDOW = 30 * 86400.0
# Most members each per-playbook set keeps, whatever their age.
SET_CAP = 200_000
# Upper bounds (seconds) of the trainmedic_time_to_resolve_seconds histogram.
RESOLVE_BUCKETS = (10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 900.0, 1800.0, 3600.0, 7200.0, 21600.0, 86400.0)


def note(r: Any, playbook: str, record_id: str, status: str, now: float, time_to_resolve: float | None = None) -> None:
    """Count a record's new outcome: it leaves the other outcome sets, joins this one, and moves the counters."""
    ms = int(now * 1000)
    pipe = r.pipeline(transaction=False)
    for other in Outcome:
        if other != status:
            pipe.zrem(keys.outcomes(other, playbook), record_id)
    key = keys.outcomes(status, playbook)
    pipe.zadd(key, {record_id: ms})
    pipe.zremrangebyscore(key, "-inf", ms - int(WINDOW * 1000))
    pipe.zremrangebyrank(key, 0, -SET_CAP - 1)
    pipe.pexpire(key, int(WINDOW * 1000))  # a playbook that is gone takes its sets with it
    pipe.hincrby(keys.OUTCOME_COUNTS, f"{playbook}|{status}", 1)
    if status == Outcome.EFFECTIVE and time_to_resolve is not None:
        times = keys.resolve_times(playbook)
        pipe.zadd(times, {f"{record_id}|{time_to_resolve:.3f}": ms})
        pipe.zremrangebyscore(times, "-inf", ms - int(WINDOW * 1000))
        pipe.zremrangebyrank(times, 0, -SET_CAP - 1)
        pipe.pexpire(times, int(WINDOW * 1000))
        slot = next((i for i, le in enumerate(RESOLVE_BUCKETS) if time_to_resolve <= le), len(RESOLVE_BUCKETS))
        pipe.hincrby(keys.RESOLVE_HISTOGRAM, f"{playbook}|{slot}", 1)
        pipe.hincrbyfloat(keys.RESOLVE_HISTOGRAM, f"{playbook}|sum", time_to_resolve)
        pipe.hincrby(keys.RESOLVE_HISTOGRAM, f"{playbook}|count", 1)
    pipe.execute()


def percentile(sorted_values: list[float], q: float) -> float | None:
    """The nearest-rank q-th percentile (0 < q <= 100) of sorted values, or None for none."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


@dataclass(frozen=True)
class Summary:
    """One playbook's outcomes over the window."""

    counts: dict[str, int]
    median: float | None
    p90: float | None

    def as_dict(self) -> dict[str, Any]:
        return {"outcomes": self.counts, "time_to_resolve_s": {"median": self.median, "p90": self.p90}}


def summaries(r: Any, playbooks: Iterable[str], now: float) -> dict[str, Summary]:
    """Each playbook's outcome counts and time to resolve over the last 30 days."""
    names = list(playbooks)
    since = int((now - WINDOW) * 1000)
    pipe = r.pipeline(transaction=False)
    for name in names:
        for status in Outcome:
            pipe.zcount(keys.outcomes(status, name), since, "+inf")
        pipe.zrangebyscore(keys.resolve_times(name), since, "+inf")
    answers = pipe.execute() if names else []
    out = {}
    per = len(Outcome) + 1
    for i, name in enumerate(names):
        row = answers[i * per:(i + 1) * per]
        times = sorted(float(m.rpartition("|")[2]) for m in row[-1])
        out[name] = Summary(dict(zip(values(Outcome), map(int, row[:-1]))), percentile(times, 50),
                            percentile(times, 90))
    return out


def counts(r: Any) -> tuple[dict[tuple[str, str], int], dict[str, tuple[list[int], float, int]]]:
    """For /metrics: outcome counts by (playbook, outcome), and each playbook's histogram (buckets, sum, count)."""
    outcome_counts: dict[tuple[str, str], int] = {}
    for field, value in r.hgetall(keys.OUTCOME_COUNTS).items():
        playbook, _, status = field.rpartition("|")
        outcome_counts[(playbook, status)] = int(value)
    hist: dict[str, tuple[list[int], float, int]] = {}
    for field, value in r.hgetall(keys.RESOLVE_HISTOGRAM).items():
        playbook, _, part = field.rpartition("|")
        buckets, total, n = hist.get(playbook, ([0] * (len(RESOLVE_BUCKETS) + 1), 0.0, 0))
        if part == "sum":
            total = float(value)
        elif part == "count":
            n = int(value)
        elif part.isdigit() and int(part) <= len(RESOLVE_BUCKETS):
            buckets[int(part)] = int(value)
        hist[playbook] = (buckets, total, n)
    return outcome_counts, hist
