"""Alert episodes from what Prometheus remembers: `ALERTS{alertstate="firing"}` over a window, read in chunks,
each unbroken run of a series one episode (what `trainmedic replay` feeds through the engine)."""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Iterable, Mapping

from ..prometheus import Prometheus

QUERY = 'ALERTS{alertstate="firing"}'
# Prometheus refuses a query_range of more than 11,000 points per series: a chunk asks for at most this many.
POINTS_PER_QUERY = 10_000
# The longest window replay reads.
MAX_WINDOW = 31 * 86400.0


@dataclass(frozen=True)
class Window:
    """The replayed time: from `start` to `end` (seconds since the epoch) at `step`."""

    start: float
    end: float
    step: float

    def chunks(self) -> list[tuple[float, float]]:
        """(start, end) of each query_range, on one grid of `step`, at most POINTS_PER_QUERY points each."""
        out = []
        at = self.start
        while at <= self.end:
            last = min(self.end, at + (POINTS_PER_QUERY - 1) * self.step)
            out.append((at, last))
            at = last + self.step
        return out

    @property
    def last(self) -> float:
        """The last instant of the grid (a run that reaches it was still firing at the end)."""
        return self.start + int((self.end - self.start) // self.step) * self.step


@dataclass(frozen=True)
class Episode:
    """One alert episode: its labels (less alertstate), when it fired, and when it resolved (None: it was still
    firing at the window's end)."""

    labels: Mapping[str, str]
    start: float
    end: float | None

    @property
    def alertname(self) -> str:
        return self.labels.get("alertname", "")


def read(prometheus: Prometheus, window: Window) -> tuple[list[Episode], int]:
    """Every episode of the window, by start, and how many series there were (PrometheusError when it cannot be
    read)."""
    samples: dict[tuple[tuple[str, str], ...], list[float]] = {}
    for start, end in window.chunks():
        series, _ = prometheus.query_range(QUERY, start, end, window.step, limit=None)
        for s in series:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("__name__", "alertstate")))
            samples.setdefault(labels, []).extend(t for t, _ in s.points)
    out = [ep for labels, times in samples.items() for ep in runs(dict(labels), times, window)]
    out.sort(key=lambda ep: (ep.start, sorted(ep.labels.items())))
    return out, len(samples)


def runs(labels: Mapping[str, str], times: Iterable[float], window: Window) -> list[Episode]:
    """A series' unbroken runs of samples: each fired at its first sample and resolved one step after its last
    (the first evaluation that no longer found it), unless its last is the window's last."""
    out = []
    ordered = sorted(set(times))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] - ordered[j] <= window.step * 1.5:
            j += 1
        last = ordered[j]
        out.append(Episode(labels, ordered[i], None if last >= window.last - window.step / 2 else last + window.step))
        i = j + 1
    return out
