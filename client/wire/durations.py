"""Prometheus-style durations ("90s", "10m", "1h30m", "7d"), bounded so that every one is finite and short
enough for any millisecond count made from it."""
from __future__ import annotations

import math
import re

_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
# One to three terms of a count without leading zeros; the digits each unit may take keep a term under about
# three years, so any duration stays under ten. Zero is one term of 0 ("0s"). These texts are the JSON Schema
# patterns of durations in the OpenAPI document too.
TERM = r"(?:[1-9][0-9]{0,10}ms|[1-9][0-9]{0,7}s|[1-9][0-9]{0,5}m|[1-9][0-9]{0,3}h|[1-9][0-9]{0,2}d|[1-9][0-9]?w|[1-9]y)"
POSITIVE = f"^{TERM}{{1,3}}$"
PATTERN = f"^(?:0(?:ms|s|m|h|d|w|y)|{TERM}{{1,3}})$"
_WHOLE = re.compile(PATTERN.replace("$", r"\Z"))
_PART = re.compile(r"([0-9]+)(ms|s|m|h|d|w|y)")
MAX_SECONDS = 10 * 365 * 86400.0
HINT = "use e.g. 30s, 10m, 1h30m, 7d; at most three terms, each under about three years"


def parse_duration(text: object) -> float:
    """Seconds in a duration such as "10m"; a bare number means seconds. Raises ValueError."""
    if isinstance(text, bool):
        raise ValueError(f"{text!r} is not a duration")
    if isinstance(text, (int, float)):
        try:
            seconds = float(text)
        except OverflowError:
            seconds = math.inf
        if not math.isfinite(seconds):
            raise ValueError(f"duration {text!r} is not a finite number")
        if not 0 <= seconds <= MAX_SECONDS:
            raise ValueError(f"duration {text!r} must be from 0 to {MAX_SECONDS:.0f} seconds")
        return seconds
    if not isinstance(text, str) or not _WHOLE.match(text):
        raise ValueError(f"{text!r} is not a duration ({HINT})")
    return sum(int(n) * _UNITS[unit] for n, unit in _PART.findall(text))
