"""Prometheus's HTTP API, as trainmedic asks it: the alert's expression around a remediation (the pages),
and `when:` conditions (the reconciler). Every query has a short timeout; answers are cached in Redis."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

from .http import Http, HttpError
from .promql import code

# Most series one chart draws (an expression may return hundreds: the first ones are shown, and counted).
MAX_SERIES = 8
MAX_POINTS = 240


class PrometheusError(Exception):
    """A query that gave no answer; the message is one sentence for the page or the record."""


@dataclass(frozen=True)
class Series:
    """One series of a range query: its labels and its finite points (seconds, value)."""

    labels: dict[str, str]
    points: tuple[tuple[float, float], ...]

    @property
    def name(self) -> str:
        shown = {k: v for k, v in self.labels.items() if k != "__name__"}
        return ", ".join(f"{k}={v}" for k, v in sorted(shown.items())) or self.labels.get("__name__", "value")


def expr_of(generator_url: str | None) -> str | None:
    """The alert's PromQL expression from its generatorURL (Prometheus puts it in `g0.expr`), or None."""
    if not generator_url:
        return None
    try:
        values = parse_qs(urlsplit(generator_url).query).get("g0.expr")
    except ValueError:
        return None
    expr = values[0].strip() if values else ""
    return expr or None


_COMPARISONS = ("==", "!=", ">=", "<=", ">", "<")
_SET_OPERATORS = re.compile(r"\b(and|or|unless)\b")


@dataclass(frozen=True)
class Comparison:
    """An alert expression `VALUE OP THRESHOLD` split at its top-level comparison."""

    value: str
    op: str
    threshold: str

    @property
    def constant(self) -> float | None:
        """The threshold when it is a plain number."""
        return _finite(self.threshold) if re.fullmatch(r"[-+]?[0-9.eE+-]+", self.threshold.strip()) else None


def split_comparison(expr: str) -> Comparison | None:
    """`max(x) > 2 * median(x)` as its value side, operator and threshold side; None when it is not one
    comparison at the top level (a chart of a comparison alone would only show while the alert fires)."""
    scanned = code(expr)
    depth, found, skip_to = 0, [], 0
    for i, c in scanned.chars:
        if i < skip_to:
            continue  # the second character of a two-character operator
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0:
            op = next((o for o in _COMPARISONS if expr.startswith(o, i)), None)
            if op and not expr.startswith("=~", i) and not expr.startswith("!~", i):
                found.append((i, op))
                skip_to = i + len(op)
    if len(found) != 1 or _SET_OPERATORS.search(scanned.text(len(expr))):
        return None
    at, op = found[0]
    value, threshold = expr[:at].strip(), expr[at + len(op):].strip()
    threshold = re.sub(r"^bool\b", "", threshold).strip()
    if not value or not threshold:
        return None
    return Comparison(value, op, threshold)


def _finite(text: Any) -> float | None:
    try:
        v = float(text)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


class Prometheus:
    """One Prometheus server (TRAINMEDIC_PROMETHEUS_URL)."""

    def __init__(self, url: str, timeout: float = 2.0):
        self.url = url
        # One try: a page must stay fast when Prometheus is slow, and the next view asks again.
        self.http = Http(url, timeout=timeout, retries=0)

    def _data(self, path: str, params: dict[str, Any]) -> Any:
        try:
            body = self.http.get(path, params=params)
        except HttpError as exc:
            raise PrometheusError(_why(exc)) from None
        if not isinstance(body, dict) or body.get("status") != "success":
            raise PrometheusError("Prometheus did not answer with data")
        return body.get("data") or {}

    def query_range(self, expr: str, start: float, end: float, step: float,
                    limit: int | None = MAX_SERIES) -> tuple[list[Series], int]:
        """The expression's series from start to end (at most `limit` of them; None: all), and how many there
        were."""
        data = self._data("/api/v1/query_range", {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                                   "step": f"{max(step, 1.0):.3f}"})
        result = data.get("result") if isinstance(data, dict) else None
        if data.get("resultType") != "matrix" or not isinstance(result, list):
            raise PrometheusError("the expression does not give a range of numbers")
        out = []
        for item in result[:limit]:
            labels = {str(k): str(v) for k, v in (item.get("metric") or {}).items()}
            points = []
            for t, v in item.get("values") or ():
                tt, vv = _finite(t), _finite(v)
                if tt is not None and vv is not None:
                    points.append((tt, vv))
            out.append(Series(labels, tuple(points)))
        return out, len(result)

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query's result (a list of samples; empty when the expression matches nothing), now or
        at a time in the past."""
        data = self._data("/api/v1/query", {"query": expr, **({"time": f"{at:.3f}"} if at is not None else {})})
        result = data.get("result") if isinstance(data, dict) else None
        if data.get("resultType") == "scalar" and isinstance(result, list):
            return [{"value": result}]
        if not isinstance(result, list):
            raise PrometheusError("Prometheus did not answer with a result")
        return result


def _why(exc: HttpError) -> str:
    if exc.status is None:
        return "Prometheus did not answer in time or cannot be reached"
    error = exc.body.get("error") if isinstance(exc.body, dict) else None
    return f"Prometheus refused the query: {error}" if error else f"Prometheus answered HTTP {exc.status}"


def encode(groups: list[tuple[list[Series], int]]) -> str:
    """Range answers (series and how many there were, per query) as cached in Redis."""
    return json.dumps([{"total": total, "series": [{"labels": x.labels, "points": x.points} for x in series]}
                       for series, total in groups])


def decode(text: str) -> list[tuple[list[Series], int]]:
    return [([Series(x["labels"], tuple((float(t), float(v)) for t, v in x["points"])) for x in g["series"]],
             int(g["total"])) for g in json.loads(text)]
