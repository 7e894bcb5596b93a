"""A job's goodput on GET /metrics: trainmedic_job_goodput_ratio{job_name} of live jobs and
trainmedic_job_seconds_total{job_name,kind} of live jobs and those down (README: Goodput).

The figures are each account's first five tokens, as the reconciler's last fold of the job wrote them
(service/job_account.py), so a scrape reads the accounts in one MGET and copies the numbers as they are, after
whole-batch checks; the same Redis state answers on every gunicorn worker and replica.
"""
from __future__ import annotations

import re
import time
from collections.abc import Sequence
from itertools import repeat
from operator import add
from typing import Any, cast

from ..client.wire import keys
from ..client.wire.cluster import mget

from .goodput import shown_jobs
from .job_account import ACCOUNT_KEY, KINDS, Account

RATIO = "trainmedic_job_goodput_ratio"
SECONDS = "trainmedic_job_seconds_total"
_HEAD = (f"# HELP {RATIO} Productive seconds over wall-clock seconds of each live job.\n# TYPE {RATIO} gauge\n",
         f"# HELP {SECONDS} Each job's seconds by kind: productive, stall, recompute, down.\n"
         f"# TYPE {SECONDS} counter\n")
_NAMES = re.compile(r"[A-Za-z0-9_.:@\-\n]*")
_NUMBERS = b"0123456789.-+e \n"

# Each series' sample head by job name (the ratio's, then each kind's), kept between scrapes so that a scrape
# formats only the jobs it has not seen.
_heads: list[dict[str, str]] = [{} for _ in range(5)]


def metrics_text(r: Any, now: float | None = None) -> bytes:
    """trainmedic_job_goodput_ratio (live jobs) and trainmedic_job_seconds_total{kind}, as of each job's last
    fold, in Prometheus's text format: one MGET, numbers copied as the accounts hold them."""
    global _heads
    now = time.time() if now is None else now
    names = shown_jobs(r, now)
    got = mget(r, list(map(ACCOUNT_KEY.__mod__, names)))
    if not all(got):  # accounts that expired since they were listed
        names = [n for n, line in zip(names, got) if line]
        got = [line for line in got if line]
    lines = cast(list[str], got)
    if not lines:
        return (_HEAD[0] + _HEAD[1]).encode()
    # Each line's first five tokens, and whole-batch checks in C: plain job names, five tokens and a sixth
    # (the rest of the account) a line, number text where the figures are.
    split = list(map(str.split, lines, repeat(" "), repeat(5)))
    shown = list(zip(*split))
    if (len(shown) != 6 or len(shown[5]) != len(lines) or not _NAMES.fullmatch("\n".join(names))
            or " ".join(map(" ".join, shown[:5])).encode("ascii", "replace").translate(None, _NUMBERS)):
        return _careful(names, lines, now)
    if len(_heads[0]) > 2 * len(names) + 1000:  # jobs that left long ago
        _heads = [{} for _ in range(5)]
    if not all(map(_heads[0].__contains__, names)):
        for n in names:
            if n not in _heads[0]:
                _heads[0][n] = f'{RATIO}{{job_name="{n}"}} '
                for k, kind in enumerate(KINDS, 1):
                    _heads[k][n] = f'{SECONDS}{{job_name="{n}",kind="{kind}"}} '
    ratio = [h + v for h, v in zip(map(_heads[0].__getitem__, names), shown[4]) if v != "-"]
    parts = [_HEAD[0], "\n".join(ratio), "\n" if ratio else "", _HEAD[1]]
    for k in range(4):  # a counter's samples by kind: productive, stall, recompute, down
        parts += ["\n".join(map(add, map(_heads[k + 1].__getitem__, names), shown[k])), "\n"]
    return "".join(parts).encode()


def _careful(names: Sequence[str], lines: Sequence[str | None], now: float) -> bytes:
    """The same, account by account (what a batch with a line that cannot be copied as it is gets)."""
    ratios, seconds = [], []
    for n, line in zip(names, lines):
        acc = Account.decode(line)
        if acc is None or not keys.TARGET_NAME_RE.match(n):
            continue
        f = acc.figures(now)
        if f.live and f.goodput is not None:
            ratios.append(f'{RATIO}{{job_name="{n}"}} {f.goodput:.4f}\n')
        for k, v in zip(KINDS, (f.productive, f.stall, f.recompute, f.down)):
            seconds.append(f'{SECONDS}{{job_name="{n}",kind="{k}"}} {v:.3f}\n')
    return (_HEAD[0] + "".join(ratios) + _HEAD[1] + "".join(seconds)).encode()
