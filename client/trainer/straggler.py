"""Stragglers under torch.distributed: each rank times a small fixed workload, rank 0 compares the times."""
from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .detect import DetectSettings

STRAGGLER = "TrainingStraggler"
# A probe's time when it could not be measured: ignored by the comparison, as every non-positive time is.
UNMEASURED = float("-inf")
# The fixed workload, as (N, REPS): REPS products of two N x N float32 matrices, several milliseconds (one CPU
# core takes about 50 µs for a 128 x 128 product; a GPU tens of µs for a 1024 x 1024 one), long enough that a
# CPU quota enforced per scheduler tick, or a core shared with another process, shows in it.
CPU_WORK = (128, 128)
CUDA_WORK = (1024, 64)


class Probe:
    """This rank's fixed workload on its device, timed; the same work on every rank of a job."""

    def __init__(self, device: Any):
        import torch

        self.device = device
        self.cuda = getattr(device, "type", "cpu") == "cuda"
        n, self.reps = CUDA_WORK if self.cuda else CPU_WORK
        gen = torch.Generator().manual_seed(0)
        self._a = (torch.randn(n, n, generator=gen) / math.sqrt(n)).to(device)
        self._b = torch.randn(n, n, generator=gen).to(device)
        self._out = torch.empty(n, n, device=device)
        self._torch = torch
        self._mm()  # once untimed: the first product pays for lazy initialisation, not for the rank's speed

    def _mm(self) -> None:
        mm, a, b, out = self._torch.mm, self._a, self._b, self._out
        for _ in range(self.reps):
            mm(a, b, out=out)

    def run(self) -> float:
        """Seconds the workload took on this rank now."""
        sync = self._torch.cuda.synchronize if self.cuda else None
        if sync is not None:
            sync(self.device)  # the rank's own queued work is not the probe's
        t0 = time.perf_counter()
        self._mm()
        if sync is not None:
            sync(self.device)
        return time.perf_counter() - t0


@dataclass(frozen=True)
class Straggler:
    """A rank found persistently slower than the job's median rank, and by how much at the latest comparison."""

    rank: int
    ratio: float


class Stragglers:
    """Rank 0's judge: compares every rank's probe time with the job's median rank at each comparison."""

    def __init__(self, ratio: float = 1.5, after: int = 3):
        self.ratio = ratio
        self.after = after
        self.compared = 0  # comparisons made
        self.found: Straggler | None = None  # the straggler raised now, until it is back within the ratio
        self._slow: dict[int, int] = {}  # rank -> consecutive comparisons above the ratio

    def compare(self, times: Sequence[float]) -> bool:
        """Judge one comparison of the ranks' times (seconds, by rank); True when `found` changed.

        A time that is not a positive finite number (a rank that could not measure) is ignored: that rank's
        count neither grows nor restarts. The median is a real rank's time: the middle one, of an even count the
        upper middle one (so that up to half the ranks slowed together, as by a busy host, are nobody's
        straggler), and of two ranks the faster.
        """
        self.compared += 1
        valid = {r: t for r, t in enumerate(times) if isinstance(t, float) and math.isfinite(t) and t > 0}
        if len(valid) < 2:
            return False
        ordered = sorted(valid.values())
        median = ordered[len(ordered) // 2] if len(ordered) > 2 else ordered[0]
        limit = self.ratio * median
        for r, t in valid.items():
            self._slow[r] = self._slow.get(r, 0) + 1 if t > limit else 0
        found = self.found
        if found is not None:
            now = valid.get(found.rank)
            if now is not None and now <= limit:
                self.found = None
                return True
            if now is not None:
                self.found = Straggler(found.rank, now / median)
            return False
        persistent = [r for r, n in self._slow.items() if n >= self.after and r in valid]
        if not persistent:
            return False
        slowest = max(persistent, key=lambda r: valid[r])
        self.found = Straggler(slowest, valid[slowest] / median)
        return True


# A countdown that never reaches 0 (a rank whose clock does not ask for probes, or one waiting for the times).
NEVER = 1 << 62
# While a probe is overdue (asked for, not begun), the clock thread asks again this often: the training thread's
# countdown may have overwritten its ask (a decrement of the value read before it).
ASK_AGAIN = 1.0


class ProbeClock:
    """Rank 0's schedule of probes: due every `probe_steps` steps or `probe_seconds`, whichever comes first, and
    spaced so that probes take at most `probe_share` of the run's time.

    The training thread keeps the countdown (collectives until the next probe) and asks for a probe when it
    reaches 0; this clock's daemon thread calls `due()` (which zeroes it) when the time is up, so the training
    thread never reads a clock between probes. `started` and `compared` answer the countdown to set.
    """

    def __init__(self, settings: DetectSettings, sync_every: int, due: Callable[[], None]):
        self.every = max(1, math.ceil(settings.probe_steps / sync_every))  # in collectives
        self.seconds = settings.probe_seconds
        self.share = settings.probe_share
        self._due = due
        self._planned = self.every
        self._since = time.monotonic()
        self._due_at = self._since + self.seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainmedic-probe-clock", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            wait = self._due_at - time.monotonic()
            if wait <= 0:
                self._due()
                wait = ASK_AGAIN
            # The due time only moves later while this sleeps (or to now, at start): waking early is harmless.
            if self._stop.wait(min(max(wait, 0.01), self.seconds)):
                return

    def started(self, left: int) -> int:
        """The ranks agreed on a probe now, with `left` collectives to go: none is asked for until its times
        are compared."""
        self._planned -= max(left, 0)  # the collectives since the last comparison, but for the one to come
        self._due_at = math.inf
        return NEVER

    def compared(self, cost: float) -> int:
        """The times were compared; `cost` is the slowest rank's probe (every rank waited for it)."""
        now = time.monotonic()
        per_collective = (now - self._since) / max(self._planned + 1, 1)
        gap = cost / self.share if math.isfinite(cost) and cost > 0 else 0.0
        left = self.every
        if per_collective > 0 and gap > self.every * per_collective:
            left = min(math.ceil(gap / per_collective), NEVER)
        self._planned = left
        self._since = now
        self._due_at = now + max(self.seconds, gap)
        return left

    def close(self) -> None:
        self._stop.set()


def slowest(times: Sequence[float]) -> float:
    """The longest valid probe time of a comparison (0.0 when none is valid)."""
    return max((t for t in times if math.isfinite(t) and t > 0), default=0.0)
