"""The Redis scripts of lua/, and the calls appliers make with them: claim, ack, release, reapply.

Every script names its KEYS and ARGV at the top (lua/*.lua), with the shared functions of lua/common.lua before
it. An applier writes only its own target's keys (its record, mailbox, cursor, state, journal and counts, in its
hash slot) and tells the service on its own channel when there is something to fold in; the service alone
writes the keys every target shares. The service's own scripts and their calls are service/store/scripts.py's.
"""
from __future__ import annotations

from collections.abc import Iterable
from functools import cache
from hashlib import sha1
from importlib import resources
from typing import Any

from . import keys
from .protocol import Ack, dumps, rfc3339
from .redis import run_scripts

# Upper bounds (seconds) of the dispatch-to-ack latency histogram (trainmedic_ack_latency_seconds).
ACK_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
# How long a job's ledger and a process's cursor outlive their last write.
KEEP_MS = 30 * 86400 * 1000
LEDGER_MAX = 200
REAPPLIED_MAX = 20
# How long after a claim the reconciler looks whether the claiming process is still the one alive.
CLAIM_RECHECK = 10.0


@cache
def lua(name: str) -> str:
    """The text of lua/NAME.lua, with the shared functions of lua/common.lua before it."""
    folder = resources.files(__package__).joinpath("lua")
    body = folder.joinpath(f"{name}.lua").read_text(encoding="utf-8")
    if name == "decide_many":
        # DECIDE_MANY runs DECIDE's body once per pair: as a function of its own KEYS and ARGV (and the
        # writes the pairs share, its `...`).
        decide = folder.joinpath("decide.lua").read_text(encoding="utf-8")
        body = f"local function decide_one(KEYS, ARGV, ...)\n{decide}\nend\n{body}"
    return folder.joinpath("common.lua").read_text(encoding="utf-8") + "\n" + body


class Script:
    """One script, run by its SHA-1 (EVALSHA; run_scripts loads it where Redis has lost it)."""

    def __init__(self, name: str):
        self.name = name
        self.script = lua(name)
        self.sha = sha1(self.script.encode()).hexdigest()

    def __repr__(self) -> str:
        return f"Script({self.name!r})"


# The scripts appliers run.
CLIENT_SCRIPTS = ("claim", "ack", "release", "reapply")
_scripts: dict[str, Script] = {}


def script(name: str) -> Script:
    """The script lua/NAME.lua (made once per process)."""
    s = _scripts.get(name)
    if s is None:
        s = _scripts[name] = Script(name)
    return s


Call = tuple[Script, list[str], list[Any]]


def run(r: Any, call: Call) -> Any:
    """One script call's answer."""
    return run_scripts(r, [call])[0]


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


def claim_call(target: keys.Target, entry_id: str, record_id: str | None, identity: str, now: float) -> Call:
    """The CLAIM of a mailbox entry (see lua/claim.lua)."""
    # A malformed entry names no record: it still moves the cursor, under a key that never exists.
    rec = keys.record(record_id) if record_id else keys.record_prefix(target) + "-"
    return (script("claim"), [keys.cursor(target), rec, keys.due_items(target), keys.mailbox(target),
                              keys.target_state(target), keys.journal(target), keys.target_metrics(target)],
            [entry_id, identity, _ms(now), KEEP_MS, rfc3339(now), record_id or "-", _ms(now + CLAIM_RECHECK),
             target.kind, keys.up_channel(target)])


def latency_slot(seconds: float) -> str:
    """The latency histogram's bucket of a dispatch-to-ack time: its index, or inf."""
    for i, le in enumerate(ACK_LATENCY_BUCKETS):
        if seconds <= le:
            return str(i)
    return "inf"


def ack_calls(acks: Iterable[Ack], now: float, sent: dict[str, float] | None = None) -> list[Call]:
    """One ACK call per action answer; sent: when each record's command was issued (its latency's start)."""
    from .actions import CATALOGUE

    calls = []
    for a in acks:
        t = keys.target_of_record(a.record_id)
        spec = CATALOGUE.get(a.action)
        issued = (sent or {}).get(a.record_id)
        # Clocks of the service and the applier may disagree a little: never a negative latency.
        latency = -1.0 if issued is None else max(0.0, now - issued)
        args = {"index": a.index, "status": a.status,
                "answer": dumps({"reason": a.reason, "result": a.result, "at": a.acked_at, "by": a.acked_by}),
                "acked_at": a.acked_at, "acked_by": a.acked_by, "now": _ms(now), "replayed": int(a.replayed),
                "ledger": int(bool(spec and spec.sticky and t.kind == "job")), "ledger_max": LEDGER_MAX,
                "keep_ms": KEEP_MS, "rid": a.record_id, "action": a.action if spec else "unknown",
                "latency": round(latency, 6), "slot": latency_slot(latency), "kind": t.kind,
                "up": keys.up_channel(t)}
        calls.append((script("ack"), [keys.record(a.record_id), keys.ledger(t), keys.due_items(t),
                                      keys.journal(t), keys.target_metrics(t)], [dumps(args)]))
    return calls


def release_call(record_id: str) -> Call:
    """Hand a claimed, unapplied command back to the target's next process (see lua/release.lua)."""
    t = keys.target_of_record(record_id)
    return (script("release"), [keys.record(record_id), keys.mailbox(t), keys.target_state(t)], [record_id])


def reapply_call(record_id: str, index: int, at: str, step: int | None, by: str) -> Call:
    """Note on an action that a resumed job applied it again (see lua/reapply.lua)."""
    return (script("reapply"), [keys.record(record_id)],
            [index, dumps({"at": at, "step": step, "by": by}), REAPPLIED_MAX])
