"""`when:` conditions (README: Playbooks, `when:`): PromQL whose non-empty result lets a step run.

`$job`, `$node` and `$gpu` may appear only inside the double-quoted value of a label matcher
(`{job_name="$job"}`); they are filled in escaped, so no value can change the query's shape. `check` parses
the expressions with promtool's parser when it is installed, else with a syntax check of its own.
"""
from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Mapping, Sequence

from ..promql import code

VARIABLES = ("job", "node", "gpu")
_VAR = re.compile(r"\$(job|node|gpu)\b")
_ANY_VAR = re.compile(r"\$[A-Za-z_][A-Za-z0-9_]*")
# A label matcher with a double-quoted value: name, operator, value (escapes kept).
_MATCHER = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\\n]|\\.)*)"')
_PROMTOOL_ERROR = re.compile(r'group "w(\d+)", rule \d+, "[^"]*": (?:could not parse expression: )?(.*)')
MAX_LENGTH = 2000


class MissingVariable(Exception):
    """A variable the condition uses has no value for this target (its step is condition_unknown)."""


def _escape(value: str, regex: bool) -> str:
    if regex:
        value = re.escape(value)
    return value.replace("\\", "\\\\").replace('"', '\\"')


def problem(expr: str) -> str | None:
    """Why a condition cannot be used, before parsing it (None when it can)."""
    if len(expr) > MAX_LENGTH:
        return f"when is longer than {MAX_LENGTH} characters"
    outside = _MATCHER.sub("", expr)
    bad = _ANY_VAR.search(outside)
    if bad:
        if _VAR.fullmatch(bad.group(0)):
            return (f"{bad.group(0)} may appear only inside a double-quoted label value, "
                    f'like {{job_name="{bad.group(0)}"}}')
        return f"unknown variable {bad.group(0)} (known: $job, $node, $gpu)"
    for m in _MATCHER.finditer(expr):
        unknown = [v for v in _ANY_VAR.findall(m.group(3)) if not _VAR.fullmatch(v)]
        if unknown:
            return f"unknown variable {unknown[0]} (known: $job, $node, $gpu)"
    return None


def fill(expr: str, values: Mapping[str, str | None]) -> str:
    """The expression with its variables filled in, escaped; MissingVariable when one has no value."""
    def matcher(m: re.Match[str]) -> str:
        name, op, value = m.groups()
        regex = op in ("=~", "!~")

        def var(v: re.Match[str]) -> str:
            got = values.get(v.group(1))
            if not got:
                raise MissingVariable(v.group(1))
            return _escape(got, regex)
        return f'{name}{op}"{_VAR.sub(var, value)}"'
    return _MATCHER.sub(matcher, expr)


def _own_syntax(expr: str) -> str | None:
    """Brackets balanced and strings closed (the check used when promtool is not installed)."""
    pairs, stack = {")": "(", "]": "[", "}": "{"}, []
    scanned = code(expr)
    for i, c in scanned.chars:
        if c in "([{":
            stack.append(c)
        elif c in ")]}":
            if not stack or stack.pop() != pairs[c]:
                return f"unexpected {c!r} at character {i + 1}"
    if scanned.unclosed_string:
        return "a string is not closed"
    if stack:
        return f"unclosed {stack[-1]!r}"
    return None


@dataclass(frozen=True)
class Checked:
    """Problems of a list of conditions, by position in the list."""

    problems: dict[int, str]
    parser: str  # "promtool" or "syntax"


def check(exprs: Sequence[str]) -> Checked:
    """Parse every condition (variables filled with a placeholder) with promtool, else the own syntax check."""
    return _check(tuple(exprs))


@functools.lru_cache(maxsize=64)
def _check(exprs: tuple[str, ...]) -> Checked:
    # Cached: every gunicorn worker and every check of the same files parses the same conditions.
    problems: dict[int, str] = {}
    filled: dict[int, str] = {}
    for i, e in enumerate(exprs):
        why = problem(e)
        if why:
            problems[i] = why
        else:
            filled[i] = fill(e, {v: "placeholder" for v in VARIABLES})
    promtool = shutil.which("promtool")
    if promtool is None:
        for i, e in filled.items():
            why = _own_syntax(e)
            if why:
                problems[i] = f"when is not valid PromQL: {why}"
        return Checked(problems, "syntax")
    with tempfile.TemporaryDirectory(prefix="trainmedic-when-") as tmp:
        path = Path(tmp) / "conditions.yml"
        # One group per condition, so promtool reports each one's error. JSON is valid YAML and quotes safely.
        groups = [{"name": f"w{i}", "rules": [{"record": "trainmedic:when", "expr": e}]} for i, e in filled.items()]
        path.write_text(json.dumps({"groups": groups}))
        out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=30)
    for line in (out.stdout + out.stderr).splitlines():
        m = _PROMTOOL_ERROR.search(line)
        if m and int(m.group(1)) not in problems:
            problems[int(m.group(1))] = f"when is not valid PromQL: {m.group(2).strip()}"
    return Checked(problems, "promtool")
