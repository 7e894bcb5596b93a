"""What appliers' scripts leave in their own target's keys, folded by the service into the keys every target shares.

A training job's or a node's Redis user may write only its own target's keys. Its scripts journal the record
changes its acks make (keys.journal) and count its acks, their latency, the backlog's moves and the commands it
refused (keys.target_metrics); the service takes both (lua/take.lua, which empties them) when it looks at the
target, checks every entry and field, and adds what holds to the history journal and the metrics hash. What
does not hold (a job's user may write anything into its own keys) is left out, logged and counted as a repair.
"""
from __future__ import annotations

import logging
import math
import re
from typing import Any
from collections.abc import Sequence

from ..client.wire import keys
from ..client.wire.actions import CATALOGUE
from ..client.wire.protocol import ACK_STATUSES
from ..client.wire.redis import run_scripts
from ..client.wire.scripts import ACK_LATENCY_BUCKETS
from ..client.wire.status import Outcome, RecordStatus

from . import repairs
from .store.scripts import take_call

log = logging.getLogger("trainmedic.fold")

REJECT_REASONS = ("bad_signature", "unsigned", "replayed")
_SLOTS = frozenset([*(str(i) for i in range(len(ACK_LATENCY_BUCKETS))), "inf"])
_ACTIONS = frozenset([*CATALOGUE, "unknown"])
_STATUSES = frozenset(RecordStatus)
_OUTCOMES = frozenset([*Outcome, "-"])
_ENTRY = re.compile(r"^(?:n\|([^|]+)\|[A-Za-z0-9_.-]{1,64}\|[\s\S]*|h\|([^|]+)|([co])\|([^|]+)\|([\w-]+)\|(\w+))\Z")


def entry_ok(entry: str, target: keys.Target) -> bool:
    """Whether a journal entry found in a target's own journal is one of its own records' (lua/common.lua)."""
    m = _ENTRY.match(entry)
    if not m:
        return False
    rid = m.group(1) or m.group(2) or m.group(4)
    if not keys.RECORD_ID_RE.match(rid) or keys.target_of_record(rid) != target:
        return False
    if m.group(3) == "c":
        return m.group(5) in _STATUSES and m.group(6) in _STATUSES
    if m.group(3) == "o":
        return m.group(5) in _OUTCOMES and m.group(6) in _OUTCOMES
    return True


def count_ok(name: str, value: str, target: keys.Target) -> tuple[str, float] | None:
    """A count found in a target's own metrics hash, as (field of keys.METRICS, amount); None if it does not hold."""
    kind, _, rest = name.partition("|")
    try:
        amount = float(value)
    except (TypeError, ValueError):
        return None
    if not math.isfinite(amount):
        return None
    if kind == "s":
        ok = rest in _ACTIONS and amount >= 0
    elif kind == "n":
        action, _, status = rest.partition("|")
        ok = action in _ACTIONS and status in ACK_STATUSES and amount.is_integer() and amount >= 0
    elif kind == "b":
        action, _, slot = rest.partition("|")
        ok = action in _ACTIONS and slot in _SLOTS and amount.is_integer() and amount >= 0
    elif kind == "backlog":
        ok = rest == target.kind and amount.is_integer()
    elif kind == "rej":
        ok = rest in REJECT_REASONS and amount.is_integer() and amount >= 0
    else:
        ok = False
    return (name, amount) if ok else None


def fold(r: Any, targets: Sequence[keys.Target]) -> int:
    """Take what these targets' scripts left and add what holds to the shared keys; how many journal entries."""
    targets = [t for t in dict.fromkeys(targets) if t.name]
    if not targets:
        return 0
    answers = run_scripts(r, [take_call(t) for t in targets])
    entries: list[str] = []
    ints: dict[str, int] = {}
    floats: dict[str, float] = {}
    bad = 0
    for t, (journal, counts) in zip(targets, answers):
        for entry in journal:
            if entry_ok(str(entry), t):
                entries.append(str(entry))
            else:
                bad += 1
        for name, value in zip(counts[::2], counts[1::2]):
            got = count_ok(str(name), str(value), t)
            if got is None:
                bad += 1
            elif got[0].startswith("s|"):
                floats[got[0]] = floats.get(got[0], 0.0) + got[1]
            else:
                ints[got[0]] = ints.get(got[0], 0) + int(got[1])
    if entries or ints or floats:
        pipe = r.pipeline(transaction=False)
        if entries:
            pipe.rpush(keys.HIST_JOURNAL, *entries)
        for name, n in ints.items():
            pipe.hincrby(keys.METRICS, name, n)
        for name, x in floats.items():
            pipe.hincrbyfloat(keys.METRICS, name, x)
        pipe.execute()
    if bad:
        repairs.note(r, f"{bad} journal entries or counts in the own keys of {len(targets)} target(s) "
                        "that were not trainmedic's", bad)
    return len(entries)
