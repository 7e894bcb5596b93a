"""One job's goodput account as the service keeps it in Redis: its one reader and writer (README: Goodput).

An account is one line of FIELDS space-separated tokens ("-" where a value is unknown; times after the job's
first heartbeat), about 130 characters, so that 10,000 jobs cost a few MB and GET /metrics reads the series of
every live job in one MGET. Its first five tokens are the job's figures as /metrics shows them (seconds by kind
as counters, goodput while live), written as Prometheus's text format writes numbers, so a scrape copies them
as they are.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..client.wire import keys
from ..client.wire.protocol import HEARTBEAT_TTL, LIVE_WINDOW

# keys.goodput of a job name (a pass or a scrape reads thousands of them).
ACCOUNT_KEY = keys.goodput(keys.Target("job", "%s"))
VERSION = "g2"
FIELDS = 24
DAY = 86400.0
# Down time after a process ended without close() stops growing after this long.
DOWN_MAX = DAY
KINDS = ("productive", "stall", "recompute", "down")
# A process whose heartbeat is older than this has stopped (its key has expired): its down time has begun.
BEAT_GONE = HEARTBEAT_TTL + 1.0


class Phase:
    """Where the job's latest process is: heartbeating (live), ended with close() (closed), or gone silent."""

    LIVE = "l"
    CLOSED = "c"
    GONE = "g"


@dataclass(frozen=True)
class Figures:
    """A job's figures at one moment (seconds), as GET /jobs and /metrics show them."""

    live: bool
    wall: float
    productive: float
    stall: float
    recompute: float
    down: float
    goodput: float | None


@dataclass
class Account:
    """One job's accounting: the totals of its ended processes and of its latest one so far."""

    first: float  # the first heartbeat of its first process
    last: float  # the latest heartbeat of its latest process
    productive: float = 0.0
    recompute: float = 0.0
    stall: float = 0.0
    down: float = 0.0  # down time between processes already over
    ended: float = 0.0  # the live time of its processes that ended
    high: int | None = None  # the job's highest step, across its processes
    step: int | None = None  # the step of its latest heartbeat
    phase: str = Phase.LIVE
    run: str = "-"  # its latest process (the client's run id)
    run_started: float = 0.0
    run_productive: float = 0.0  # what that process reported last
    run_recompute: float = 0.0
    run_stall: float = 0.0
    run_high: int | None = None
    run_base: int | None = None  # the job's highest step when that process began
    watch: int | None = None  # the lowest step an open incident waits for the job to pass
    # (time, highest step) at a few past heartbeats: the highest step when an alert began, for incidents.
    marks: list[tuple[float, int]] = field(default_factory=list)
    logged: int = 0  # which kinds of bad heartbeat were logged for this job (a bit each)
    shown_down: float = 0.0  # the down seconds /metrics showed last (the counter never goes back)
    listed: str = ""  # where the job index lists it: "l" live or "n" not, and "d" while it is among the down

    # -- the figures
    def silent(self, now: float) -> bool:
        """Whether its latest process stopped heartbeating without close(): down time is running."""
        return self.phase == Phase.GONE or (self.phase == Phase.LIVE and now - self.last > BEAT_GONE)

    def figures(self, now: float) -> Figures:
        """The job's figures at `now`: a process heartbeating counts to now, one gone silent counts as down."""
        beat_age = max(0.0, now - self.last)
        silent = self.silent(now)
        running = self.phase == Phase.LIVE and not silent
        span = 0.0
        if self.run != "-" and self.phase != Phase.CLOSED:
            span = max(0.0, (now if running else self.last) - self.run_started)
        down = self.down + (min(beat_age, DOWN_MAX) if silent else 0.0)
        down = max(down, self.shown_down)
        wall = self.ended + span + down
        productive, stall, recompute = self.productive, self.stall, self.recompute
        used = productive + stall + recompute
        if used > 0 and used + down > wall:  # never more than the time there was
            scale = max(0.0, wall - down) / used
            productive, stall, recompute = productive * scale, stall * scale, recompute * scale
        live = self.phase != Phase.CLOSED and beat_age <= LIVE_WINDOW
        goodput = productive / wall if self.high is not None and wall > 0 else None
        return Figures(live, wall, productive, stall, recompute, down, goodput)

    def high_at(self, t: float) -> int | None:
        """The job's highest step at time t (between two marks: in proportion), as far as the marks say."""
        if self.high is None:
            return None
        points = [*self.marks, (self.last, self.high)]
        if t >= points[-1][0]:
            return self.high
        if t <= points[0][0]:
            return points[0][1]
        for (t0, h0), (t1, h1) in zip(points, points[1:]):
            if t0 <= t <= t1:
                return h0 if t1 <= t0 else int(h0 + (h1 - h0) * (t - t0) / (t1 - t0))
        return self.high

    # -- the line
    def encode(self, shown: Figures, listed: str) -> str:
        """The account as its line: `shown` the figures /metrics reads, `listed` where the job index lists it."""
        self.shown_down, self.listed = shown.down, listed
        first = self.first
        goodput = _num(shown.goodput, 4) if shown.live and shown.goodput is not None else "-"
        marks = ",".join(f"{_num(t - first, 1)}/{h}" for t, h in self.marks) or "-"
        return " ".join((
            _num(self.productive), _num(self.stall), _num(self.recompute), _num(shown.down), goodput, VERSION,
            _num(first, 2), _num(self.last - first, 2), _num(self.down), _num(self.ended), _int(self.high),
            _int(self.step), self.phase, listed, self.run, _num(self.run_started - first, 2),
            _num(self.run_productive), _num(self.run_recompute), _num(self.run_stall), _int(self.run_high),
            _int(self.run_base), _int(self.watch), marks, str(self.logged)))

    @classmethod
    def decode(cls, line: str | None) -> Account | None:
        """The account of a line, or None when there is none or it is not one (a repair: a new one replaces it)."""
        if not line:
            return None
        t = line.split(" ")
        if len(t) != FIELDS or t[5] != VERSION or t[12] not in (Phase.LIVE, Phase.CLOSED, Phase.GONE):
            return None
        try:
            first = float(t[6])
            marks = [] if t[22] == "-" else [(first + float(a), int(b))
                                             for a, b in (m.split("/") for m in t[22].split(","))]
            acc = cls(first=first, last=first + float(t[7]), productive=float(t[0]), stall=float(t[1]),
                      recompute=float(t[2]), down=float(t[8]), ended=float(t[9]), high=_opt_int(t[10]),
                      step=_opt_int(t[11]), phase=t[12], listed=t[13], run=t[14], run_started=first + float(t[15]),
                      run_productive=float(t[16]), run_recompute=float(t[17]), run_stall=float(t[18]),
                      run_high=_opt_int(t[19]), run_base=_opt_int(t[20]), watch=_opt_int(t[21]), marks=marks,
                      logged=int(t[23]), shown_down=float(t[3]))
        except ValueError:
            return None
        numbers = (acc.first, acc.last, acc.productive, acc.recompute, acc.stall, acc.down, acc.ended,
                   acc.run_started, acc.run_productive, acc.run_recompute, acc.run_stall, acc.shown_down)
        return acc if all(math.isfinite(x) and x >= 0 for x in numbers) else None


def last_of(line: str) -> float | None:
    """When the latest heartbeat of a line's account was (the one fold compares a heartbeat with), or None."""
    t = line.split(" ", 8)
    try:
        return float(t[6]) + float(t[7]) if len(t) == 9 and t[5] == VERSION else None
    except ValueError:
        return None


def _num(x: float | None, places: int = 3) -> str:
    """A finite number as text Prometheus reads as it is ("12.5", "0.0"); "-" for None."""
    return "-" if x is None else repr(round(x, places) + 0.0)


def _int(x: int | None) -> str:
    return "-" if x is None else str(x)


def _opt_int(text: str) -> int | None:
    return None if text == "-" else int(text)
