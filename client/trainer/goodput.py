"""Goodput on rank 0: where the job's time went, from the steps poll() is given (README: Goodput).

poll() does nothing for it, so a training step costs what it did: a thread looks at the client's latest step
every SAMPLE seconds, and the time between two looks that saw the step change counts in one kind, the first
that applies: stall (the step had not changed for longer than the stall threshold: the whole span), recompute
(steps at or below the highest this process reached: after a rollback or a resume), productive (steps above
it; a span that crosses the highest is split in proportion to its steps). A span's kind is decided when the
step next changes, and a stall as soon as it passes the threshold, so the totals sent with each heartbeat
only ever grow. The highest step here is this process's own: the service knows the job's across its
processes, and counts as recompute what a resumed process did below it (service/goodput.py).
"""
from __future__ import annotations

import logging
import math
import secrets
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from ..settings import duration

log = logging.getLogger("trainmedic.client")

# How often the thread looks at the step: no figure is off by more than this at a change of kind.
SAMPLE = 0.25
DEFAULT_STALL_AFTER = 30.0
# The stall threshold is never less than this many times the job's median step time ...
STALL_STEPS = 3
# ... over this many recent spans between changes.
STEP_TIMES = 63


def stall_after(env: Mapping[str, str]) -> float:
    """TRAINMEDIC_STALL_AFTER in seconds (SettingsError, a ValueError, with one sentence when it is not one)."""
    return duration(env, "TRAINMEDIC_STALL_AFTER", DEFAULT_STALL_AFTER)


def whole_step(step: Any) -> int | None:
    """A step as a whole number, or None when it is not a finite number (bool is not a step)."""
    if isinstance(step, bool) or not isinstance(step, (int, float)):
        return None
    if isinstance(step, float) and not math.isfinite(step):
        return None
    return int(step)


class Accountant:
    """Running totals of productive, recompute and stall seconds, from a step read every SAMPLE seconds."""

    def __init__(self, stall_after: float, step: Callable[[], Any],
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        self.stall_after = stall_after
        self._read_step = step
        self._clock = clock
        self._wall = wall
        # One process of the job: the service tells its processes apart by this.
        self.run = secrets.token_hex(6)
        self.started = wall()
        self.productive = self.recompute = self.stall = 0.0
        self.first: int | None = None  # the first step this process was seen at
        self.high: int | None = None  # the highest step this process reached
        self._last: int | None = None  # the step at the latest change
        self._since = 0.0  # when that change was seen (clock)
        self._back: tuple[float, int] | None = None  # (wall time, step) of the latest step back
        self._times: deque[float] = deque(maxlen=STEP_TIMES)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    # -- the thread
    def start(self) -> Accountant:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="trainmedic-goodput", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE):
            try:
                self.sample()
            except Exception:  # the figures may suffer, the loop never does
                log.debug("trainmedic: goodput sample failed", exc_info=True)

    def stop(self) -> None:
        """Stop looking (this process's figures stop growing)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(2 * SAMPLE + 1)

    # -- the accounting
    def threshold(self) -> float:
        """Seconds without a step change after which the time since the change is a stall."""
        if not self._times:
            return self.stall_after
        return max(self.stall_after, STALL_STEPS * statistics.median(self._times))

    def sample(self) -> None:
        """Look at the step now: a change closes the span since the previous one, counted in its kind."""
        step = whole_step(self._read_step())
        if step is None or self._closed:
            return
        now = self._clock()
        with self._lock:
            last = self._last
            if last is None or self.high is None:  # the first step: time before it is in wall_s only
                self.first = self.high = self._last = step
                self._since = now
                return
            if step == last:
                return
            span = now - self._since
            if span > self.threshold():
                self.stall += span
            elif step > last:
                fresh = step - max(last, self.high)  # steps above the highest, the rest were done before
                share = fresh / (step - last) if fresh > 0 else 0.0
                self.productive += span * share
                self.recompute += span - span * share
                self._times.append(span / (step - last))
            else:  # a step back within the span: what followed it is done again
                self.recompute += span
            if step < last:
                self._back = (self._wall(), step)
            self.high = max(self.high, step)
            self._last = step
            self._since = now

    def report(self) -> dict[str, Any]:
        """The totals for the heartbeat: a stall under way counts up to now (it only grows until it ends)."""
        now = self._clock()
        with self._lock:
            stall = self.stall
            if self._last is not None and not self._closed:
                idle = now - self._since
                if idle > self.threshold():
                    stall += idle
            return {"run": self.run, "started": round(self.started, 3), "productive_s": round(self.productive, 3),
                    "recompute_s": round(self.recompute, 3), "stall_s": round(stall, 3), "first_step": self.first,
                    "high": self.high, "back": [round(self._back[0], 3), self._back[1]] if self._back else None}

    def close(self) -> dict[str, Any]:
        """Count the time since the last change (the loop ended) and stop; the last report, for close()."""
        self.stop()
        self.sample()
        now = self._clock()
        with self._lock:
            if self._last is not None and not self._closed and self.high is not None:
                span = now - self._since
                if span > self.threshold():
                    self.stall += span
                elif self._last >= self.high:
                    self.productive += span
                else:
                    self.recompute += span
                self._since = now
            self._closed = True
        return self.report()
