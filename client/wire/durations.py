"""Prometheus-style durations ("90s", "10m", "1h30m", "7d"), bounded by value so that every one is finite and
short enough for any millisecond count made from it."""
from __future__ import annotations

import math
import re

_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
# The same units in whole milliseconds: the bound is checked exactly, never through a rounded float.
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000,
            "y": 31_536_000_000}
# The longest duration anywhere: ten 365-day years, however it is written (3650d, 10y, 87600h, 521w3d ...).
MAX_SECONDS = 10 * 365 * 86400.0
MAX_TEXT = "3650d"
_MAX_MS = int(MAX_SECONDS) * 1000
# A count of more digits than this is over the maximum in any unit (10**12 ms, the least of them, is 31
# years), so it is refused without being turned into an int: a huge run of digits costs nothing.
_MAX_DIGITS = 12
_UNIT_RE = "(?:ms|s|m|h|d|w|y)"
# The syntax: one to three terms of a count without leading zeros, or zero as one term ("0s"). The maximum
# is a value, checked after parsing.
_SYNTAX = re.compile(rf"(?:0{_UNIT_RE}|(?:[1-9][0-9]*{_UNIT_RE}){{1,3}})\Z")
_PART = re.compile(r"([0-9]+)(ms|s|m|h|d|w|y)")
HINT = f"use e.g. 30s, 10m, 1h30m, 7d; at most three terms and {MAX_TEXT} in all"
TOO_LONG = f"the longest duration allowed is {MAX_TEXT} ({MAX_SECONDS:.0f} seconds)"


def _at_most(n: int) -> str:
    """A regex for the counts 1..n, written without leading zeros."""
    digits = str(n)
    alts = [f"[1-9][0-9]{{0,{len(digits) - 2}}}"] if len(digits) > 1 else []
    for i, d in enumerate(digits):
        lo, hi = (1 if i == 0 else 0), int(d) - 1
        if hi >= lo:
            rest = len(digits) - i - 1
            alts.append(digits[:i] + (f"[{lo}-{hi}]" if hi > lo else str(lo)) + (f"[0-9]{{{rest}}}" if rest else ""))
    return "(?:" + "|".join([*alts, digits]) + ")"


def _term_up_to(limit_ms: int) -> str:
    """A regex for one term (count and unit) of at most limit_ms milliseconds."""
    return "(?:" + "|".join(f"{_at_most(limit_ms // ms)}{unit}" for unit, ms in _UNIT_MS.items()
                            if limit_ms >= ms) + ")"


# The JSON Schema patterns of durations in the OpenAPI document. A regex cannot add terms up, so these admit
# every single term up to the maximum and two or three terms of at most a third of it each: every text they
# match is accepted, and the service also accepts the other sums that stay within the maximum.
_SOUND = f"{_term_up_to(_MAX_MS)}|{_term_up_to(_MAX_MS // 3)}{{2,3}}"
POSITIVE = f"^(?:{_SOUND})$"
PATTERN = f"^(?:0{_UNIT_RE}|{_SOUND})$"
SCHEMA_NOTE = (f"One to three terms adding up to at most {MAX_TEXT}; the pattern admits any single term up to "
               f"{MAX_TEXT} and two or three terms of up to {_MAX_MS // 3 // _UNIT_MS['d']}d each.")


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
            raise ValueError(f"duration {text!r} must be from 0 to {MAX_SECONDS:.0f} seconds ({MAX_TEXT})")
        return seconds
    if not isinstance(text, str) or not _SYNTAX.match(text):
        raise ValueError(f"{text!r} is not a duration ({HINT})")
    terms = _PART.findall(text)
    if any(len(n) > _MAX_DIGITS for n, _ in terms) or sum(int(n) * _UNIT_MS[u] for n, u in terms) > _MAX_MS:
        raise ValueError(f"duration {text!r} is too long: {TOO_LONG}")
    return sum(int(n) * _UNITS[unit] for n, unit in terms)
