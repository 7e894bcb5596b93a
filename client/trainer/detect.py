"""Loss detectors that run in the training thread (a non-finite loss, a spike over the recent median), and the
knobs of every in-loop detector (the stragglers' too: client/trainer/straggler.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

NAN = "TrainingLossNaN"
SPIKE = "TrainingLossSpike"
ALERTS = (NAN, SPIKE)


@dataclass(frozen=True)
class DetectSettings:
    """The detectors' knobs (README: the training client): RemediationClient(detect={...}) overrides them."""

    nan: bool = True
    spike: bool = True
    # A spike: above `factor` times the median of the previous `window` normal losses, `consecutive`
    # observations in a row, judged from the `warmup`-th observation on.
    window: int = 50
    factor: float = 2.0
    consecutive: int = 3
    warmup: int = 20
    # A detection clears after this many consecutive normal losses (its alert then resolves).
    clear_after: int = 20
    # ...and only a rise that is large against the loss's own scale counts: above the median by at least
    # `min_rise` times the run's early loss (the median of the losses seen during `warmup`: a run converged
    # to the floating-point noise floor, or a loss that is 0 for long stretches, never spikes), and by at
    # least `noise` times the recent losses' spread (their 90th percentile above their median: the batch
    # to batch noise of a plateau is no spike). 0 turns either off.
    min_rise: float = 0.01
    noise: float = 3.0
    # Stragglers (torch.distributed only): each rank times a small fixed workload every `probe_steps` steps or
    # `probe_seconds`, whichever comes first; a rank slower than `straggler_ratio` times the job's median rank
    # in `straggler_after` comparisons in a row is a straggler. The probes are spaced further apart when they
    # would otherwise take more than `probe_share` of the run's time (its ranks wait for the slowest probe).
    straggler: bool = True
    straggler_ratio: float = 1.5
    straggler_after: int = 3
    probe_steps: int = 300
    probe_seconds: float = 60.0
    probe_share: float = 0.005

    @classmethod
    def of(cls, detect: Any) -> DetectSettings | None:
        """The settings `detect=` asks for: True or None (defaults), False (off) or a dict of overrides."""
        if detect is None or detect is True:
            return cls()
        if detect is False:
            return None
        if not isinstance(detect, dict):
            raise ValueError("detect must be True, False or a dict of detector settings")
        known = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(detect) - set(known))
        if unknown:
            raise ValueError(f"detect has unknown settings {', '.join(unknown)} (known: {', '.join(known)})")
        for name, value in detect.items():
            if name in _SWITCHES:
                if not isinstance(value, bool):
                    raise ValueError(f"detect[{name!r}] must be True or False")
            elif name in _NUMBERS:
                low, strict, high, what = _NUMBERS[name]
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                        math.isfinite(value) and (value > low if strict else value >= low) and value <= high):
                    raise ValueError(f"detect[{name!r}] must be a finite number {what}")
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1 or value > 100_000:
                raise ValueError(f"detect[{name!r}] must be a whole number from 1 to 100000")
        values: dict[str, Any] = {k: (float(v) if k in _NUMBERS else v) for k, v in detect.items()}
        return cls(**values)


_SWITCHES = ("nan", "spike", "straggler")
# The settings that are real numbers: the lower bound each must pass (strictly or not), the upper one, and how
# an error names them.
_NUMBERS = {"factor": (1.0, True, math.inf, "above 1"), "min_rise": (0.0, False, math.inf, "of 0 or more"),
            "noise": (0.0, False, math.inf, "of 0 or more"),
            "straggler_ratio": (1.0, True, math.inf, "above 1"),
            "probe_seconds": (0.0, True, math.inf, "above 0"),
            "probe_share": (0.0, True, 1.0, "above 0 and at most 1")}


# The median behind the spike threshold is recomputed after this many normal losses (and when the warm-up
# ends): the previous 50 losses' median, at most this many observations old. Sorting 50 floats at every
# step would cost several times the whole budget of a step's poll().
REFRESH_EVERY = 10
# Taken off `_left` while a detection is on (far below any count of losses), and given back when it clears.
_ON = 1 << 40


class Detector:
    """Judges each loss it observes; `nan` and `spike` say what is detected now (each until it clears)."""

    __slots__ = ("s", "nan", "spike", "changed", "_ring", "_i", "_end", "_total", "_since", "_limit", "_left",
                 "_over", "_normal", "_active", "_floor", "_early")

    def __init__(self, settings: DetectSettings):
        self.s = settings
        self.nan = False
        self.spike = False
        self.changed = 0  # bumped at every change of nan or spike
        self._ring: list[float] = [0.0] * settings.window  # the previous normal losses (spikes stay out)
        self._i = 0
        self._end = settings.window - 1
        self._total = 0  # normal losses observed before the latest refresh of the limit
        # Twice the median: a finite loss above it is a spike observation (inf while warming up, or off).
        self._limit = math.inf
        # Normal losses until the limit is recomputed; while a detection is on, it stays at or below zero so
        # that every normal loss counts towards clearing it (one test on the fast path instead of two).
        self._left = self._since = max(settings.warmup - 1, 0)
        self._over = 0
        self._normal = 0
        self._active = False  # a detection is on: normal losses count towards clearing it
        # The least rise above the median that counts, from the run's early losses (None: not learned yet).
        self._floor: float | None = None
        self._early = 0.0  # the size of the run's early losses (once the warm-up ends)

    def observe(self, x: float) -> bool:
        """Judge one loss; True when what is detected changed (a detection began or cleared)."""
        # x - x is 0.0 for a finite loss and NaN (truthy) for NaN and the infinities.
        if x - x or x > self._limit:
            return self._unusual(x)
        i = self._i
        self._ring[i] = x
        self._i = i + 1 if i != self._end else 0
        self._over = 0
        self._left -= 1
        if self._left <= 0:
            return self._normal_seen()
        return False

    def _unusual(self, x: float) -> bool:
        self._normal = 0
        if x - x:
            if self.s.nan and not self.nan:
                self.nan = True
                return self._began()
            return False
        self._over += 1
        if self._over >= self.s.consecutive and not self.spike:
            self.spike = True
            return self._began()
        return False

    def _began(self) -> bool:
        if not self._active:
            self._active = True
            self._left -= _ON  # every normal loss now reaches _normal_seen
        self.changed += 1
        return True

    def _normal_seen(self) -> bool:
        if self._active:
            self._left += _ON
        if self._left <= 0:
            self._total += self._since - self._left  # the normal losses since the last refresh
            self._left = self._since = REFRESH_EVERY
            self._refresh()
        if not self._active:
            return False
        self._left -= _ON
        self._normal += 1
        if self._normal < self.s.clear_after:
            return False
        self.nan = self.spike = self._active = False
        self._left += _ON
        self._normal = 0
        self.changed += 1
        return True

    def _refresh(self) -> None:
        if not self.s.spike:  # no limit to keep: nothing to sort
            return
        values = sorted(self._ring if self._total >= self.s.window else self._ring[:self._i])
        if not values:
            self._limit = math.inf
            return
        n = len(values)
        m = n >> 1
        median = values[m] if n & 1 else (values[m - 1] + values[m]) * 0.5
        if self._floor is None:  # the end of the warm-up: these are the run's early losses
            self._early = _scale(values, median)
            self._floor = self.s.min_rise * self._early
        # A median below zero gives no meaningful "twice as high": no spike is judged then.
        if median < 0:
            self._limit = math.inf
            return
        # The rise must also be large against the loss's own scale: the run's early losses and the spread of
        # the recent ones (at the floating-point noise floor, twice the median is noise too).
        rise = self.s.noise * (values[(9 * (n - 1)) // 10] - median)
        if rise < self._floor:
            rise = self._floor
        # A run sitting at exactly zero (float32's noise floor, a hinge loss once the margin holds) has no scale
        # of its own left: "twice as high" is then against its early losses (a corrupt shard is far above them,
        # the odd batch with a positive loss is not); with none, no spike is judged.
        limit = self.s.factor * (median or self._early or math.inf)
        self._limit = limit if limit > median + rise else median + rise


def _scale(values: list[float], median: float) -> float:
    """The size of a run's early losses: their median's, else (mostly exactly 0) their mean absolute value."""
    return abs(median) or sum(abs(v) for v in values) / len(values)
