"""Jobs' training signals as their heartbeats left them in Redis: for GET /metrics and the hang checks.

Each job's client writes one short line (client/wire/protocol.signals_line) beside its heartbeat, with a TTL
of two minutes. Its numbers are already written as the text format writes them, so a scrape reads only the live
jobs (keys.live: the service's own count of heartbeats), their lines in one MGET, checks the whole batch at once
and joins the lines it needs: no per-job Python on the way.
"""
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from itertools import chain, compress, repeat
from operator import add, ne
from typing import Any

from ..client.wire import keys
from ..client.wire.cluster import mget
from ..client.wire.protocol import parse_signals

# (metric name, help, index in a signals line), in the order /metrics lists them.
GAUGES = (
    ("trainmedic_training_loss", "The job's latest training loss (the highest over its ranks).", 2),
    ("trainmedic_training_step", "The job's latest training step.", 0),
    ("trainmedic_training_learning_rate", "The job's learning rate (its first parameter group, on rank 0).", 3),
    ("trainmedic_training_samples_per_second",
     "Samples the job processes per second (the lowest over its ranks).", 4),
    ("trainmedic_training_grad_norm", "The job's latest gradient norm (the highest over its ranks).", 5),
)


def recent_jobs(r: Any, now: float, within: float) -> list[keys.Target]:
    """Jobs whose latest heartbeat is at most `within` seconds old (keys.live scores when it stops counting)."""
    since = int((now - within) * 1000)
    out = []
    for label in r.zrangebyscore(keys.live("job"), since, "+inf"):
        t = keys.parse_label(label)
        if t is not None and t.kind == "job":
            out.append(t)
    return out


def read(r: Any, jobs: Sequence[keys.Target]) -> list[tuple[keys.Target, tuple[float | None, ...]]]:
    """Each job's signals (jobs with none, or a line that is not one, are left out)."""
    lines = mget(r, [keys.signals(t) for t in jobs])
    out = []
    for t, line in zip(jobs, lines):
        if line:
            values = parse_signals(line)
            if values is not None:
                out.append((t, values))
    return out


FIELDS = len(GAUGES) + 1  # a line's fields: the gauges' and step_since
# What labels copied as they are may hold besides their "job:" (names that need no escaping in a label value),
# and what lines copied as they are may hold (numbers, "-" for unknown, single spaces between fields).
_LABEL_BYTES = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:@-\n"
_LINE_BYTES = b"0123456789.eE+- "
_SIGNALS_KEY = keys.PREFIX + "{%s}:signals"  # keys.signals of a label
# Each gauge's sample head ('trainmedic_training_loss{job_name="NAME"} ') by job label, kept between scrapes
# so that a scrape formats only jobs it has not seen; replaced whole when it outgrows the jobs reporting.
_heads: list[dict[str, str]] = [{} for _ in GAUGES]


def _number(v: float) -> str:
    return repr(int(v)) if v.is_integer() and abs(v) < 2 ** 53 else repr(v)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def reporting(r: Any, now: float) -> list[str]:
    """Labels of the live jobs, whose signals line may exist."""
    return [str(x) for x in r.zrangebyscore(keys.live("job"), int(now * 1000), "+inf")]


def metrics_text(r: Any, now: float | None = None) -> bytes:
    """The training gauges in Prometheus's text format: one series per job and metric, for every live job whose
    heartbeat wrote signals (a job's series go when it is no longer live)."""
    now = time.time() if now is None else now
    labels = reporting(r, now)
    lines = mget(r, list(map(_SIGNALS_KEY.__mod__, labels)))
    have = list(map(bool, lines))
    if not all(have):  # lines that expired since, or a job in the index that never wrote one
        labels, lines = list(compress(labels, have)), list(compress(lines, have))
    body = _copied(labels, lines) if lines else None
    if body is None:
        body = _formatted(labels, lines)
    return "".join(chain.from_iterable(zip(_HEADERS, body))).encode()


_HEADERS = [f"# HELP {name} {help_text}\n# TYPE {name} gauge\n" for name, help_text, _ in GAUGES]


def _copied(labels: list[str], lines: list[Any]) -> list[str] | None:
    """Each gauge's samples from lines copied as they are; None unless every label and number is fit to copy."""
    global _heads
    # Whole-batch checks in C: every label a job's with a plain name, every line six fields of number text.
    if (not all(map(str.startswith, labels, repeat("job:")))
            or "\n".join(labels).encode("ascii", "replace").translate(None, _LABEL_BYTES)):
        return None
    joined = " ".join(lines)
    if joined.encode("ascii", "replace").translate(None, _LINE_BYTES):
        return None
    tokens = joined.split(" ")
    if len(tokens) != FIELDS * len(lines):
        return None
    heads = _heads
    if len(heads[0]) > 2 * len(labels) + 1000:  # jobs that stopped reporting long ago
        heads = _heads = [{} for _ in GAUGES]
    if not all(map(heads[-1].__contains__, labels)):
        for label in labels:
            if label not in heads[-1]:
                middle = f'{{job_name="{label[4:]}"}} '
                for (name, _, _), by_label in zip(GAUGES, heads):
                    by_label[label] = name + middle
    out = []
    for (_, _, index), by_label in zip(GAUGES, heads):
        values = tokens[index::FIELDS]
        known = list(map(ne, values, repeat("-")))
        named = labels
        if not all(known):
            values, named = list(compress(values, known)), list(compress(labels, known))
        try:  # one bad number (or one too large to be finite) sends the whole scrape the careful way
            # No NaN can pass the byte check, so the sum is finite exactly when every value is (or on an
            # overflow of the sum itself, which the careful way then settles).
            if not math.isfinite(sum(map(float, values))):
                return None
        except ValueError:
            return None
        text = "\n".join(map(add, map(by_label.__getitem__, named), values))
        out.append(text + "\n" if text else "")
    return out


def _formatted(labels: Sequence[str], lines: Sequence[Any]) -> list[str]:
    """Each gauge's samples, line by line: what a batch that cannot be copied as it is gets (bad lines left out)."""
    rows = []
    for label, line in zip(labels, lines):
        t = keys.parse_label(label)
        if t is None or t.kind != "job" or not isinstance(line, str):
            continue
        values = parse_signals(line)
        if values is not None:
            rows.append((_escape(t.name), values))
    out = []
    for name, _, index in GAUGES:
        prefix = name + '{job_name="'
        out.append("".join(f'{prefix}{n}"}} {_number(x)}\n' for n, v in rows
                           if (x := v[index]) is not None and math.isfinite(x)))
    return out
