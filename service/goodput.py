"""Goodput: what each job's time went to across its processes, and when its incidents recovered (README: Goodput).

The training client on rank 0 counts its own productive, recompute and stall seconds and sends the totals with
each heartbeat (client/trainer/goodput.py). Every reconciler pass calls fold() with the heartbeats of the jobs
the service knows; fold keeps each job's account (service/job_account.py) in service-only keys:

- the totals across the job's processes: each heartbeat adds what its process counted since the one before
  (a process is its client's run id); what a resumed process counted as productive below the job's highest
  step, which only the service knows across processes, moves to recompute, in proportion to the steps;
- `down`: from the last heartbeat of a process that ended without close() (its heartbeat expired, or another
  process of the job began) to the first heartbeat of the next, or to now while none has come, up to 24 hours;
- the job's highest step, first and last heartbeat, whether it is live, and an index of jobs by name;
- per new record of the job, its highest step when the alert began, and when its step first passed it
  (service/incidents.py).

A heartbeat's totals that go backwards, exceed the process's time, are negative or not finite are ignored or
clamped, logged once per job; a job name that fails the target-name rule never reaches a key. Keys live 30 days
after their job's last heartbeat.
"""
from __future__ import annotations

import json
import logging
import math
import re
from types import MappingProxyType
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from ..client.wire import keys
from ..client.wire.cluster import mget

from . import incidents
from .job_account import ACCOUNT_KEY, DAY, DOWN_MAX, Account, Figures, Phase, last_of

log = logging.getLogger("trainmedic.goodput")

RETENTION = 30 * DAY
# A heartbeat's totals may exceed its process's time by this much (rounding, a clock read a moment apart).
SLACK = 1.0
# The highest step is marked at heartbeats this far apart (two marks: the step when an alert began).
MARK_EVERY = 30.0
MARKS = 2
# Jobs swept for retention per pass.
SWEEP = 200
# Heartbeats this close in time are the same one (an account keeps its times to 10 ms, from its first).
SAME = 0.02
# A silent job's account (its down time growing) is written again once /metrics would show this much more.
REFRESH = 5.0
_NUMBER = re.compile(r"[0-9.eE+-]+")
RUN_RE = re.compile(r"^[0-9a-f]{8,32}\Z")
# Bad heartbeats, one bit each in Account.logged (logged once per job).
BAD = {"invalid": 1, "backwards": 2, "exceeds": 4, "stale": 8}
WHY = {"invalid": "its goodput totals are negative, not numbers or not finite: ignored",
       "backwards": "its goodput totals went backwards: ignored",
       "exceeds": "its goodput totals exceed its process's time: clamped to it",
       "stale": "it came from a process older than the job's latest: ignored"}
_HEARTBEAT_KEY = keys.heartbeat(keys.Target("job", "%s"))


@dataclass(frozen=True)
class Report:
    """What one heartbeat says of its process's time (client/trainer/goodput.py Accountant.report)."""

    run: str
    started: float
    productive: float
    recompute: float
    stall: float
    first: int | None
    high: int | None
    back: tuple[float, int] | None  # (when, step) of the process's latest step back

    @classmethod
    def of(cls, g: Any) -> Report | None:
        """The report of a heartbeat's "goodput" object, or None when it is not a sound one."""
        if not isinstance(g, dict) or not isinstance(g.get("run"), str) or not RUN_RE.match(g["run"]):
            return None
        numbers: list[Any] = [g.get(k) for k in ("started", "productive_s", "recompute_s", "stall_s")]
        if not all(_finite(x) and x >= 0 for x in numbers):
            return None
        first, high, back = g.get("first_step"), g.get("high"), g.get("back")
        if not all(x is None or _whole(x) for x in (first, high)):
            return None
        if back is not None and not (isinstance(back, list) and len(back) == 2 and _finite(back[0])
                                     and _whole(back[1])):
            return None
        return cls(g["run"], float(numbers[0]), float(numbers[1]), float(numbers[2]), float(numbers[3]), first, high,
                   (float(back[0]), int(back[1])) if back is not None else None)


@dataclass
class _Job:
    """One job within a pass: its account, and what this pass's heartbeat changed."""

    target: keys.Target
    acc: Account | None
    beat: Mapping[str, Any] | None
    changed: bool = False
    prev: tuple[float, int | None] | None = None  # (time, step) of the heartbeat before this pass's


# -- the pass ---------------------------------------------------------------------------------------------

# What beats_of_known_jobs gives for a heartbeat its account folded already: nothing to do.
FOLDED: Mapping[str, Any] = MappingProxyType({})


def fold(r: Any, beats: Sequence[tuple[keys.Target, Mapping[str, Any] | None]], now: float,
         lines: Mapping[str, str | None] | None = None) -> int:
    """Fold the jobs' heartbeats (None: the job's heartbeat key is gone) into their accounts; the jobs written.
    `lines`: accounts the caller read already, by job name (the others are read here)."""
    named = {t.name: beat for t, beat in beats if beat is not FOLDED and t.kind == "job"
             and keys.TARGET_NAME_RE.match(t.name)}
    given = {t.name for t, beat in beats if beat is FOLDED}
    listed = set(shown_jobs(r, now)) - given
    for name in listed:  # live and down jobs whose heartbeat the caller did not give: it is gone
        named.setdefault(name, None)
    # A job with no heartbeat that is neither live nor down has nothing to fold.
    names = [n for n, b in named.items() if b is not None or n in listed]
    known = lines or {}
    unread = [n for n in names if n not in known]
    read = dict(zip(unread, mget(r, list(map(ACCOUNT_KEY.__mod__, unread)))))
    # Most heartbeats were folded in an earlier pass (a pass a second, a heartbeat every 5): only the account's
    # time of its latest one is read for them.
    fresh = []
    for n in names:
        beat, line = named[n], known[n] if n in known else read[n]
        if not _seen(beat, line):
            fresh.append(_Job(keys.Target("job", n), Account.decode(line), beat))
    for j in fresh:
        _beat(j, now)
    incidents.recover(r, [(j.target, j.acc, j.prev, _back(j.beat)) for j in fresh
                          if j.changed and j.acc is not None and j.prev is not None])
    # Down time grows: the accounts of jobs gone silent are written again every few seconds, for /metrics.
    written = [j for j in fresh if j.changed or (j.acc is not None and j.acc.silent(now)
                                                  and j.acc.figures(now).down - j.acc.shown_down >= REFRESH)]
    noted = incidents.discover(r, now, {j.target.name: j.acc for j in fresh if j.acc is not None})
    for name, acc in noted.items():  # accounts whose watch for an incident's recovery changed
        if all(j.target.name != name for j in written):
            written.append(_Job(keys.Target("job", name), acc, None))
    _write(r, written, now)
    _sweep(r)
    return len(written)


def _back(beat: Mapping[str, Any] | None) -> tuple[float, int] | None:
    """When and to which step the heartbeat's process last went back (a rollback), or None."""
    report = Report.of((beat or {}).get("goodput"))
    return report.back if report is not None else None


def _seen(beat: Mapping[str, Any] | None, line: str | None) -> bool:
    """Whether this heartbeat is the one the account folded last (nothing to do)."""
    if beat is None or not line:
        return False
    last, seen = last_of(line), cast(Any, beat.get("last_seen"))
    return last is not None and _finite(seen) and float(seen) <= last + SAME


def beats_of_known_jobs(r: Any, now: float) -> tuple[list[tuple[keys.Target, Mapping[str, Any] | None]],
                                                       dict[str, str | None]]:
    """The heartbeat of each job whose heartbeat key may still exist (keys.live scores when it stops counting),
    and its account: FOLDED for a heartbeat the account folded already (its JSON is not parsed), else parsed."""
    labels = r.zrangebyscore(keys.live("job"), int((now - 5) * 1000), "+inf")
    # Labels come from the clients' heartbeats: a name that fails the target-name rule reaches no key.
    names = [label[4:] for label in labels if label.startswith("job:") and keys.TARGET_NAME_RE.match(label[4:])]
    raws = mget(r, list(map(_HEARTBEAT_KEY.__mod__, names)))
    lines = mget(r, list(map(ACCOUNT_KEY.__mod__, names)))
    beats: list[tuple[keys.Target, Mapping[str, Any] | None]] = []
    for name, raw, line in zip(names, raws, lines):
        seen, last = _last_seen(raw), last_of(line) if line else None
        folded = seen is not None and last is not None and seen <= last + SAME
        beats.append((keys.Target("job", name), FOLDED if folded else _parsed(raw)))
    return beats, dict(zip(names, lines))


def _last_seen(raw: str | None) -> float | None:
    """A heartbeat's time, read from its JSON without parsing it all (None when it cannot be read so)."""
    at = raw.rfind('"last_seen":') if raw else -1
    m = _NUMBER.match(raw, at + 12) if raw and at >= 0 else None
    try:
        return float(m.group()) if m else None
    except ValueError:
        return None


def fold_known(r: Any, now: float) -> None:
    """The reconciler's call each pass: fold the heartbeats of the jobs it knows (a bug here stops no pass)."""
    try:
        beats, lines = beats_of_known_jobs(r, now)
        fold(r, beats, now, lines)
    except Exception as exc:
        if type(exc).__module__.startswith("redis"):
            raise
        log.exception("goodput: a pass failed; the next pass goes on from the accounts as they are")


# -- one job's heartbeat ------------------------------------------------------------------------------------

def _beat(j: _Job, now: float) -> None:
    """Apply the job's heartbeat (or its absence) to its account."""
    acc, beat = j.acc, j.beat
    if beat is None:
        if acc is not None and acc.phase == Phase.LIVE:
            acc.phase = Phase.GONE  # it stopped heartbeating without close(): down from its last heartbeat
            j.changed = True
        return
    seen: Any = beat.get("last_seen")
    if not _finite(seen) or "goodput" not in beat:
        return  # a client that keeps no goodput figures (an earlier version) has none to show
    seen = float(seen)
    if acc is not None and seen <= acc.last + SAME:
        return  # the heartbeat fold saw already
    report = Report.of(beat["goodput"])
    if acc is None:
        started = report.started if report is not None else seen
        acc = j.acc = Account(first=min(started, seen), last=seen)
    j.changed = True
    j.prev = (acc.last, acc.step)
    if report is None:
        _bad(j.target, acc, "invalid")
        acc.last = seen
        return
    if report.run != acc.run:
        if acc.run != "-" and report.started < acc.run_started:
            _bad(j.target, acc, "stale")
            return
        _new_run(acc, report, seen)
    elif acc.phase == Phase.CLOSED:
        return  # a closed process does not come back
    elif acc.phase == Phase.GONE:
        # The same process again (its Redis was out of reach a while): it counted that time itself.
        acc.shown_down = acc.down
    _add(j.target, acc, report, seen)
    step: Any = beat.get("step")
    acc.step = int(step) if _whole(step) else acc.step
    acc.phase = Phase.CLOSED if beat.get("closed") is True else Phase.LIVE
    if acc.phase == Phase.CLOSED:
        acc.ended += max(0.0, acc.last - acc.run_started)


def _new_run(acc: Account, report: Report, seen: float) -> None:
    """The job's next process began: the one before it ended at its last heartbeat."""
    if acc.run != "-" and acc.phase != Phase.CLOSED:
        acc.ended += max(0.0, acc.last - acc.run_started)
        gap = min(max(0.0, report.started - acc.last), DOWN_MAX)
        acc.down = max(acc.down + gap, acc.shown_down)
    # Live time is counted once where processes overlap (the next one began before the last one's end).
    acc.run_started = max(report.started, acc.last) if acc.run != "-" else min(report.started, seen)
    acc.run = report.run
    acc.run_productive = acc.run_recompute = acc.run_stall = 0.0
    acc.run_high = report.first
    acc.run_base = acc.high
    acc.phase = Phase.LIVE


def _add(target: keys.Target, acc: Account, report: Report, seen: float) -> None:
    """Add what the process counted since its previous heartbeat."""
    p, r, s = report.productive, report.recompute, report.stall
    span = max(0.0, seen - report.started)
    if p + r + s > span + SLACK:
        _bad(target, acc, "exceeds")
        scale = span / (p + r + s)
        p, r, s = p * scale, r * scale, s * scale
    dp, dr, ds = p - acc.run_productive, r - acc.run_recompute, s - acc.run_stall
    if min(dp, dr, ds) < -0.001:
        _bad(target, acc, "backwards")
        acc.last = seen
        return
    dp, dr, ds = max(0.0, dp), max(0.0, dr), max(0.0, ds)
    # Productive time below the job's highest step when this process began was recompute for the job: the
    # process's own highest step went from `low` (at its previous heartbeat, or its first step) to `high`.
    low = acc.run_high if acc.run_high is not None else report.first
    base, high = acc.run_base, report.high
    if base is not None and low is not None and high is not None and dp > 0 and low < base:
        share = 1.0 if high <= low else min(1.0, (base - low) / (high - low))
        dr, dp = dr + dp * share, dp - dp * share
    acc.productive += dp
    acc.recompute += dr
    acc.stall += ds
    acc.run_productive, acc.run_recompute, acc.run_stall = p, r, s
    if high is not None:
        acc.run_high = high if acc.run_high is None else max(acc.run_high, high)
        # The previous heartbeat's highest step is marked when the newest mark is MARK_EVERY older than it.
        if acc.high is not None and (not acc.marks or acc.last - acc.marks[-1][0] >= MARK_EVERY):
            acc.marks = [*acc.marks, (acc.last, acc.high)][-MARKS:]
        acc.high = high if acc.high is None else max(acc.high, high)
    acc.last = seen


def _bad(target: keys.Target, acc: Account, kind: str) -> None:
    """Log a bad heartbeat of the job once (per kind of problem)."""
    if not acc.logged & BAD[kind]:
        acc.logged |= BAD[kind]
        log.warning("goodput: a heartbeat of job %s was not sound (%s); logged once for this job", target.name,
                    WHY[kind], extra={"target": target.label})


# -- writing ------------------------------------------------------------------------------------------------

def _write(r: Any, jobs: list[_Job], now: float) -> None:
    """Store the accounts, and list each job as live or not (and among the down ones while it is)."""
    pipe = r.pipeline(transaction=False)
    for j in jobs:
        acc = j.acc
        if acc is None:
            continue
        shown = acc.figures(now)
        name = j.target.name
        down = acc.silent(now) and now - acc.last < DOWN_MAX
        listed = ("l" if shown.live else "n") + ("d" if down else "")
        if listed != acc.listed:  # the indexes change only when where the job belongs does
            other = "n" if shown.live else "l"
            pipe.zrem(keys.GOODPUT_JOBS, f"{other}:{name}")
            pipe.zadd(keys.GOODPUT_JOBS, {f"{listed[0]}:{name}": 0})
            if down:
                pipe.zadd(keys.GOODPUT_DOWN, {name: int((acc.last + DOWN_MAX) * 1000)})
            else:
                pipe.zrem(keys.GOODPUT_DOWN, name)
        pipe.set(keys.goodput(j.target), acc.encode(shown, listed), px=int(RETENTION * 1000))
    pipe.zremrangebyscore(keys.GOODPUT_DOWN, "-inf", int(now * 1000))
    pipe.execute()


def _sweep(r: Any) -> None:
    """Drop from the index a few jobs whose account expired (30 days without a heartbeat)."""
    after = r.get(keys.GOODPUT_SWEEP) or "n:"
    names = r.zrange(keys.GOODPUT_JOBS, f"({after}", "+", bylex=True, offset=0, num=SWEEP)
    r.set(keys.GOODPUT_SWEEP, names[-1] if len(names) == SWEEP else "n:")
    if not names:
        return
    there = mget(r, [keys.goodput(keys.Target("job", m[2:])) for m in names])
    gone = [m for m, line in zip(names, there) if line is None]
    if gone:
        r.zrem(keys.GOODPUT_JOBS, *gone)


# -- reading ------------------------------------------------------------------------------------------------

def accounts(r: Any, names: Sequence[str]) -> list[Account | None]:
    """The accounts of these jobs (None where a job has none)."""
    return [Account.decode(line) for line in mget(r, [keys.goodput(keys.Target("job", n)) for n in names])]


def figures_of(r: Any, names: Sequence[str], now: float) -> list[Figures | None]:
    return [None if a is None else a.figures(now) for a in accounts(r, names)]


def shown_jobs(r: Any, now: float) -> list[str]:
    """The jobs the index lists as live and those down (a process ended without close()): /metrics shows them,
    and fold looks at them whether or not their heartbeat is given."""
    pipe = r.pipeline(transaction=False)
    pipe.zrange(keys.GOODPUT_JOBS, "[l:", "(l;", bylex=True)
    pipe.zrangebyscore(keys.GOODPUT_DOWN, int(now * 1000), "+inf")
    live, down = pipe.execute()
    names = [m[2:] for m in live]
    if down:
        names += set(down).difference(names)
    return names


# -- small helpers --------------------------------------------------------------------------------------------

def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _whole(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parsed(raw: str | None) -> dict[str, Any] | None:
    """A heartbeat's JSON, or None when it is absent or not a JSON object of finite numbers."""
    if not raw:
        return None
    try:
        value = json.loads(raw, parse_constant=_refuse)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _refuse(name: str) -> Any:
    raise ValueError(f"{name} is not a finite number")
