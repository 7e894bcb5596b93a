"""Jobs' training signals as their heartbeats left them in Redis: for GET /metrics and the hang checks.

Each live job's client writes one short line (client/wire/protocol.signals_line) beside its heartbeat, with a
TTL of two minutes. A scrape reads the jobs whose heartbeat is at most that old (keys.live) and their lines
in one MGET, and writes the text format itself: 50,000 samples through prometheus_client's families cost
several times the whole budget of a scrape.
"""
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from trainmedic.client.wire import keys
from trainmedic.client.wire.protocol import SIGNALS_TTL, parse_signals
from trainmedic.client.wire.redis import is_cluster

# (metric name, help, index in a signals line), in the order /metrics lists them.
GAUGES = (
    ("trainmedic_training_loss", "The job's latest training loss (the highest over its ranks).", 2),
    ("trainmedic_training_step", "The job's latest training step.", 0),
    ("trainmedic_training_learning_rate", "The job's learning rate (its first parameter group, on rank 0).", 3),
    ("trainmedic_training_samples_per_second",
     "Samples the job processes per second (the lowest over its ranks).", 4),
    ("trainmedic_training_grad_norm", "The job's latest gradient norm (the highest over its ranks).", 5),
)
CHUNK = 5000


def mget(r: Any, names: Sequence[str]) -> list[str | None]:
    """Values of many keys in as few round trips as the keyspace allows (slots split on a cluster)."""
    out: list[str | None] = []
    for i in range(0, len(names), CHUNK):
        part = list(names[i:i + CHUNK])
        out.extend(r.mget_nonatomic(part) if is_cluster(r) else r.mget(part))
    return out


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


def _number(v: float) -> str:
    if math.isfinite(v):
        return repr(v)
    return "NaN" if v != v else "+Inf" if v > 0 else "-Inf"


def metrics_text(r: Any, now: float | None = None) -> bytes:
    """The training gauges in Prometheus's text format: one series per job and metric, for every job that
    heartbeated within the last two minutes (a job's series go two minutes after its heartbeats stop)."""
    now = time.time() if now is None else now
    # keys.live scores a job a little after its latest heartbeat, so this takes every job that may still have
    # a line; a line's own TTL (two minutes after the heartbeat that wrote it) drops the rest.
    rows = read(r, recent_jobs(r, now, SIGNALS_TTL))
    out: list[str] = []
    for name, help_text, index in GAUGES:
        out.append(f"# HELP {name} {help_text}\n# TYPE {name} gauge\n")
        prefix = name + '{job_name="'
        # Job names match keys.TARGET_NAME_RE: nothing in them needs escaping in a label value.
        out.extend(f'{prefix}{t.name}"}} {_number(x)}\n' for t, v in rows if (x := v[index]) is not None)
    return "".join(out).encode()
