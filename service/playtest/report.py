"""How a test's made records compare with the expected ones: the matching rule, the diff people read, and
JUnit XML for CI."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Mapping, Sequence
from xml.etree import ElementTree

from .cases import EXPECT_KEYS, Expected, span

# What a made record shows in a diff when the expected one does not name more.
SHOWN = ("at", "playbook", "target", "status", "reason", "actions", "outcome")
_PLAIN = re.compile(r"^[A-Za-z0-9_.:@/+-]+\Z")


@dataclass(frozen=True)
class Record:
    """A record a test made, with the fields an expected record may name (`at`: seconds into the test)."""

    fields: Mapping[str, Any]
    params: tuple[Mapping[str, Any], ...]

    @classmethod
    def of(cls, rec: Mapping[str, Any], at: float) -> Record:
        """From the record as the API shows it, made `at` seconds into the test."""
        t = rec["target"]
        outcome = rec.get("outcome")
        fields = {"at": at, "playbook": rec["playbook"], "target": f"{t['kind']}:{t.get('name') or ''}",
                  "alertname": rec["alert"]["alertname"], "status": rec["status"], "reason": rec.get("reason"),
                  "actions": tuple(a["action"] for a in rec["actions"]),
                  "action_statuses": tuple(f"{a['status']}/{a['reason']}" if a.get("reason") else a["status"]
                                           for a in rec["actions"]),
                  "outcome": outcome["status"] if outcome else None, "stage": rec["escalation"]["stage"]}
        return cls(fields, tuple(a["params"] for a in rec["actions"]))


@dataclass
class Result:
    """One test's verdict: ok, or the lines that say why not."""

    file: str
    name: str
    line: int
    seconds: float
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def _text(value: Any) -> str:
    """A value in YAML's flow style, as a test file would write it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return value if _PLAIN.match(value) and value not in ("null", "true", "false") else json.dumps(value)
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_text(v) for v in value) + "]"
    return json.dumps(value)


def _action(item: Any) -> Any:
    return {item[0]: item[1]} if isinstance(item, tuple) else item


def expected_text(e: Expected) -> str:
    return "{" + ", ".join(f"{k}: {_shown(k, e.fields[k])}" for k in EXPECT_KEYS if k in e.fields) + "}"


def _shown(key: str, value: Any) -> str:
    if key == "at":
        return span(value)
    if key == "actions":
        return _text([_action(a) for a in value])
    return _text(value)


def made_text(m: Record, like: Expected | None = None) -> str:
    """The made record with the fields a test names by default, and any others `like` names (actions with
    their parameters when `like` compares them)."""
    names = [k for k in EXPECT_KEYS if k in SHOWN or (like is not None and k in like.fields)]
    parts = []
    for k in names:
        value = m.fields[k]
        if k == "reason" and value is None and not (like and "reason" in like.fields):
            continue
        if k == "actions" and like is not None and any(isinstance(a, tuple) for a in like.fields.get(k, ())):
            value = tuple(zip(value, m.params))
        parts.append(f"{k}: {_shown(k, value)}")
    return "{" + ", ".join(parts) + "}"


def mismatches(e: Expected, m: Record) -> list[str]:
    """The fields of `e` that the made record does not have, one phrase each ([] when it matches)."""
    out = []
    for key, want in e.fields.items():
        got = m.fields[key]
        if key == "at":
            same = math.floor(want + 1e-6) == math.floor(got + 1e-6)
        elif key == "action_statuses":
            same = len(want) == len(got) and all(w == g or ("/" not in w and w == g.split("/", 1)[0])
                                                 for w, g in zip(want, got))
        elif key == "actions":
            same = len(want) == len(got) and all(
                (w[0] == g and w[1] == p) if isinstance(w, tuple) else w == g
                for w, g, p in zip(want, got, m.params))
            if not same and any(isinstance(w, tuple) for w in want):
                got = tuple(zip(got, m.params))
        else:
            same = want == got
        if not same:
            out.append(f"{key}: expected {_shown(key, want)}, made {_shown(key, got)}")
    return out


def _aligned(expected: Sequence[Expected], made: Sequence[Record]) -> list[tuple[int | None, int | None]]:
    """Pairs (expected index, made index) in order: matching records paired (the longest such run), then the
    rest of each gap paired in turn, and what is left over alone."""
    n, k = len(expected), len(made)
    ok = [[not mismatches(expected[i], made[j]) for j in range(k)] for i in range(n)]
    best = [[0] * (k + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        for j in range(k - 1, -1, -1):
            best[i][j] = best[i + 1][j + 1] + 1 if ok[i][j] else max(best[i + 1][j], best[i][j + 1])
    pairs: list[tuple[int | None, int | None]] = []
    gap_e: list[int] = []
    gap_m: list[int] = []

    def flush() -> None:
        for x in range(max(len(gap_e), len(gap_m))):
            pairs.append((gap_e[x] if x < len(gap_e) else None, gap_m[x] if x < len(gap_m) else None))
        gap_e.clear()
        gap_m.clear()

    i = j = 0
    while i < n or j < k:
        if i < n and j < k and ok[i][j] and best[i][j] == best[i + 1][j + 1] + 1:
            flush()
            pairs.append((i, j))
            i, j = i + 1, j + 1
        elif j < k and (i >= n or best[i][j + 1] >= best[i + 1][j]):
            gap_m.append(j)
            j += 1
        else:
            gap_e.append(i)
            i += 1
    flush()
    return pairs


def diff(expected: Sequence[Expected], made: Sequence[Record]) -> list[str]:
    """The expected (-) and made (+) records, one line each, with what differs under each pair; [] when they
    are equal one for one."""
    pairs = _aligned(expected, made)
    if all(e is not None and m is not None and not mismatches(expected[e], made[m]) for e, m in pairs):
        return []
    out = ["expected (-) and made (+) records, in the order they were made:"]
    for e, m in pairs:
        if e is not None and m is not None and not mismatches(expected[e], made[m]):
            out.append(f"    {expected_text(expected[e])}")
            continue
        if e is not None:
            out.append(f"  - {expected_text(expected[e])}  (line {expected[e].line})")
        if m is not None:
            out.append(f"  + {made_text(made[m], expected[e] if e is not None else None)}")
        if e is None:
            out.append("      made, but not expected")
        elif m is None:
            out.append("      expected, but not made")
        else:
            out.extend(f"      {x}" for x in mismatches(expected[e], made[m]))
    return out


def junit(results: Sequence[Result]) -> bytes:
    """JUnit XML: a suite per test file, a case per test, a failure holding the diff."""
    root = ElementTree.Element("testsuites", name="trainmedic test", tests=str(len(results)),
                               failures=str(sum(not r.ok for r in results)))
    files: dict[str, list[Result]] = {}
    for r in results:
        files.setdefault(r.file, []).append(r)
    for file, rs in files.items():
        suite = ElementTree.SubElement(root, "testsuite", name=file, tests=str(len(rs)),
                                       failures=str(sum(not r.ok for r in rs)),
                                       time=f"{sum(r.seconds for r in rs):.3f}")
        for r in rs:
            case = ElementTree.SubElement(suite, "testcase", name=r.name, classname=file, file=file,
                                          line=str(r.line), time=f"{r.seconds:.3f}")
            if not r.ok:
                failure = ElementTree.SubElement(case, "failure", message=r.problems[0])
                failure.text = "\n".join(r.problems)
    return ElementTree.tostring(root, encoding="utf-8", xml_declaration=True)
