"""What the views share: the app's extension, the JSON body of a write, the live targets."""
from __future__ import annotations

import json
import re
import time
from typing import Any

from flask import current_app, request

from ...client.wire import keys
from ...client.wire.actions import is_finite_number
from ...client.wire.protocol import LIVE_WINDOW, rfc3339

from .. import lemons
from ..errors import BadRequest, PayloadTooLarge, UnsupportedMediaType


def ext() -> Any:
    """The app's trainmedic Extension (settings, Redis, playbooks, dispatcher, reconciler, metrics)."""
    return current_app.extensions["trainmedic"]


def _no_constant(name: str) -> Any:
    # json.loads takes NaN, Infinity and -Infinity unless told otherwise: numbers must be finite.
    raise ValueError(f"{name} is not a finite number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not is_finite_number(value):
        raise ValueError(f"{text} is too large to be a finite number")
    return value


def _finite_int(text: str) -> int:
    value = int(text)
    if not is_finite_number(value):  # 10**400 is as infinite to a float-based reader as 1e999
        raise ValueError(f"an integer of {len(text.lstrip('-'))} digits is too large to be a finite number")
    return value


# A JSON escape of a UTF-16 surrogate; json.loads joins valid pairs into one character, so any left is unpaired.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _unpaired_surrogate(value: Any) -> bool:
    """Whether any string in the parsed value (keys included) holds an unpaired surrogate (not text)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if any("\ud800" <= c <= "\udfff" for c in v):
                return True
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


def _unique(pairs: list[tuple[str, Any]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"the key {dup!r} appears twice in one object")
    return out


def read_json() -> Any:
    """The request's JSON body, or a 413 / 415 / 400 with one sentence (README: HTTP API)."""
    limit = current_app.config["MAX_CONTENT_LENGTH"]
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"the body is larger than {limit // 1024} KiB")
    if request.mimetype != "application/json":
        raise UnsupportedMediaType("the body must be sent as Content-Type: application/json")
    # A chunked body has no length up front, and Werkzeug stops a stream at the limit without a word: read
    # one byte past it, so that a body over the limit is refused rather than cut to fit.
    request.max_content_length = limit + 1
    data = request.get_data(cache=False)
    if len(data) > limit:
        raise PayloadTooLarge(f"the body is larger than {limit // 1024} KiB")
    try:
        text = data.decode("utf-8")
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float, parse_int=_finite_int,
                           object_pairs_hook=_unique)
    except UnicodeDecodeError:
        raise BadRequest("the body is not valid UTF-8") from None
    except RecursionError:
        raise BadRequest("the JSON body is nested too deeply") from None
    except ValueError as exc:
        why = str(exc) if "finite" in str(exc) or "twice" in str(exc) else ""
        raise BadRequest(f"the body is not valid JSON{': ' + why if why else ''}") from None
    if _SURROGATE_ESCAPE.search(text) and _unpaired_surrogate(value):
        # Stored, it would break every page that shows it (a str holding one cannot be encoded as UTF-8).
        raise BadRequest("the body holds an unpaired UTF-16 surrogate escape, which is not text")
    return value


def live_targets(r: Any) -> list[dict]:
    """Training clients and node agents with a recent heartbeat, sorted by kind and name; a process whose last
    heartbeat says it closed is not live any more."""
    now = time.time()
    r.zremrangebyscore(keys.TARGETS, "-inf", now - 86400)
    labels = r.zrangebyscore(keys.TARGETS, now - LIVE_WINDOW, "+inf")
    pipe = r.pipeline(transaction=False)
    for label in labels:
        kind, _, name = label.partition(":")
        pipe.get(keys.heartbeat(keys.Target(kind, name)))
    out = []
    for label, raw in zip(labels, pipe.execute()):
        info = _heartbeat(raw)
        if info is None or info.get("closed") is True:
            continue
        kind, _, name = label.partition(":")
        seen = info.pop("last_seen")
        out.append({**info, "kind": kind, "name": name, "last_seen": rfc3339(seen),
                    "age_seconds": round(now - seen, 3)})
    out.sort(key=lambda t: (t["kind"], t["name"]))
    # A node's incidents of the last 7 days are the service's count (the agent's own words never stand for it).
    recent = lemons.recent(r, [t["name"] for t in out if t["kind"] == "node"], now)
    for t in out:
        if t["kind"] == "node":
            t["incidents_7d"] = recent.get(t["name"], 0)
        else:
            t.pop("incidents_7d", None)
    return out


def _heartbeat(raw: str | None) -> dict | None:
    """A heartbeat as its process wrote it, or None when it cannot be shown. Trainers and agents write these
    with their own Redis access: one that is not JSON, holds NaN, or says it was sent in year 33658 must not
    turn GET /targets and every page into a 500."""
    if not raw:
        return None
    try:
        info = json.loads(raw, parse_constant=_no_constant, parse_float=_finite_float, parse_int=_finite_int)
        if not isinstance(info, dict):
            return None
        seen = float(info.get("last_seen", 0))
        rfc3339(seen)  # a time a date can hold
    except (ValueError, TypeError, OverflowError, OSError, RecursionError):
        return None
    info["last_seen"] = seen
    return info
