"""Prometheus-style durations ("90s", "10m", "1h30m", "7d")."""
from __future__ import annotations

import re

_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
_PART = re.compile(r"(\d+)(ms|s|m|h|d|w|y)")


def parse_duration(text: object) -> float:
    """Seconds in a duration such as "10m"; a bare number means seconds. Raises ValueError."""
    if isinstance(text, bool):
        raise ValueError(f"{text!r} is not a duration")
    if isinstance(text, (int, float)):
        if text < 0:
            raise ValueError(f"duration {text!r} is negative")
        return float(text)
    if not isinstance(text, str) or not text:
        raise ValueError(f"{text!r} is not a duration (use e.g. 30s, 10m, 24h, 7d)")
    pos, total = 0, 0.0
    for m in _PART.finditer(text):
        if m.start() != pos:
            break
        total += int(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if pos != len(text):
        raise ValueError(f"{text!r} is not a duration (use e.g. 30s, 10m, 24h, 7d)")
    return total
