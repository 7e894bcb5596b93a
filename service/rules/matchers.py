"""Alertmanager matcher syntax: name="v", name!="v", name=~"re", name!~"re" (regexes fully anchored)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from collections.abc import Mapping

_MATCHER = re.compile(r'^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*(.*?)\s*$', re.S)
_UNQUOTED = re.compile(r'^[^"\'{},=~!\s]*$')


class MatcherError(ValueError):
    """A matcher that does not parse."""


@dataclass(frozen=True)
class Matcher:
    """One label condition; an absent label counts as the empty string, as in Alertmanager."""

    name: str
    op: str
    value: str
    regex: re.Pattern | None = field(default=None, compare=False, repr=False)

    def matches(self, labels: Mapping[str, str]) -> bool:
        v = labels.get(self.name, "")
        if self.op == "=":
            return v == self.value
        if self.op == "!=":
            return v != self.value
        hit = self.regex.fullmatch(v) is not None  # type: ignore[union-attr]
        return hit if self.op == "=~" else not hit

    def __str__(self) -> str:
        return f"{self.name}{self.op}{json.dumps(self.value)}"


def parse_matcher(text: object) -> Matcher:
    """A Matcher from its text, or MatcherError saying why not."""
    if not isinstance(text, str):
        raise MatcherError(f"matcher must be a string like alertname=\"X\", not {text!r}")
    m = _MATCHER.match(text)
    if not m:
        raise MatcherError(f"bad matcher {text!r}: expected name=\"value\", name!=\"value\", name=~\"re\" or "
                           'name!~"re"')
    name, op, raw = m.groups()
    if raw.startswith('"'):
        try:
            value = json.loads(raw)
        except ValueError:
            raise MatcherError(f"bad matcher {text!r}: the quoted value is not closed or has a bad escape") from None
        if not isinstance(value, str):
            raise MatcherError(f"bad matcher {text!r}: the value must be one quoted string")
    elif _UNQUOTED.match(raw):
        value = raw
    else:
        raise MatcherError(f"bad matcher {text!r}: quote the value with double quotes")
    regex = None
    if op in ("=~", "!~"):
        try:
            regex = re.compile(f"(?:{value})", re.S)
        except re.error as exc:
            raise MatcherError(f"bad matcher {text!r}: invalid regular expression ({exc})") from None
    return Matcher(name, op, value, regex)
