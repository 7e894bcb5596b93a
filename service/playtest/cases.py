"""What a playbook test file holds, once read: its targets and playbooks, its tests, their events and the
records they expect."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from collections.abc import Mapping

from ..rules.playbooks import Playbook
from .outside import Answer, Live

# What an expected record may give; each is compared with the record as the API shows it.
EXPECT_KEYS = ("at", "playbook", "target", "alertname", "status", "reason", "actions", "action_statuses", "outcome",
               "stage")


def span(seconds: float) -> str:
    """A duration as a test file writes it: 0s, 9m, 1h30m, 1d2h, 1s500ms (at most three terms)."""
    if seconds < 0:
        return f"-{span(-seconds)}"
    d, rest = divmod(int(round(seconds * 1000)), 86_400_000)
    h, rest = divmod(rest, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s, ms = divmod(rest, 1000)
    terms = [[d, "d"], [h, "h"], [m, "m"], [s, "s"], [ms, "ms"]]
    if sum(1 for n, _ in terms if n) > 3:  # days as hours, then the milliseconds left out
        terms[1][0], terms[0][0] = h + 24 * d, 0
        if sum(1 for n, _ in terms if n) > 3:
            terms[4][0] = 0
    return "".join(f"{n}{u}" for n, u in terms if n) or "0s"


@dataclass(frozen=True)
class Event:
    """Something that happens at `at` seconds into a test: one notification, or a person's decision."""

    at: float
    line: int
    firing: tuple[Mapping[str, str], ...] = ()
    resolved: tuple[Mapping[str, str], ...] = ()
    verb: str | None = None  # approve | reject
    playbook: str | None = None  # whose newest held record the person decides

    def describe(self) -> str:
        """The event as people read it in a diff."""
        if self.verb:
            return f"{self.verb} {self.playbook}"
        return ", ".join([f"firing {a['alertname']}" for a in self.firing]
                         + [f"resolved {a['alertname']}" for a in self.resolved])


@dataclass(frozen=True)
class Expected:
    """One record a test expects: the fields it gives, as written (`at` in seconds into the test)."""

    line: int
    fields: Mapping[str, Any]


@dataclass(frozen=True)
class Case:
    """One test: its events, how targets answer, the `when:` results, and the records it expects."""

    name: str
    line: int
    events: tuple[Event, ...]
    answer: Answer
    conditions: Mapping[str, bool]
    until: float
    expect: tuple[Expected, ...]


@dataclass(frozen=True)
class TestFile:
    """A test file: the playbooks under test, the live targets, and its tests."""

    path: str
    playbooks: tuple[Playbook, ...]
    targets: tuple[Live, ...]
    cases: tuple[Case, ...]

    __test__ = False  # not a pytest class
