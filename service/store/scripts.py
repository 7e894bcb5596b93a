"""The service's script calls: DECIDE_MANY, APPROVE, RECONCILE, DEFERRED, VERDICT, BREAKER, MARK and FOLD.

Each call is a (script, KEYS, ARGV) triple built here, with the KEYS and ARGV its lua/*.lua names at its top,
and its answer read back into a type. The service writes the keys every target shares: on a single Redis its
scripts journal record changes into the global history journal and count into the global metrics hash; on
Redis Cluster (a script touches one slot) into the target's own, which the service then names among the
targets to fold in (keys.HIST_DIRTY).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from collections.abc import Iterable, Mapping, Sequence

import redis

from ...client.wire import cluster, keys
from ...client.wire.protocol import dumps, rfc3339
from ...client.wire.redis import run_scripts
from ...client.wire.scripts import CLIENT_SCRIPTS, Call, script

from .. import repairs
from ..lemons import FORGET_AFTER as INCIDENT_KEEP, WINDOW as INCIDENT_WINDOW
from .decision import Early, NewRecord, early_arg

# The scripts only the service runs (appliers run CLIENT_SCRIPTS).
SERVICE_SCRIPTS = ("decide_many", "approve", "reconcile", "deferred", "verdict", "breaker", "mark", "fold", "take")
ALL_SCRIPTS = (*SERVICE_SCRIPTS, *CLIENT_SCRIPTS)


def load_scripts(r: Any, only_if_missing: bool = True) -> bool:
    """Load every script into Redis (each primary of a cluster), by default only when Redis has lost them (a
    restart empties its script cache); True when it loaded them. The service does this at start and every
    reconciler tick, since trainers and agents may only run scripts, not load them."""
    scripts = [script(name) for name in ALL_SCRIPTS]
    if only_if_missing and all(r.script_exists(*[s.sha for s in scripts])):
        return False
    for s in scripts:
        r.script_load(s.script)
    return True


class Keyspace:
    """Where the service's scripts journal and count, for one Redis (see the module's docstring)."""

    def __init__(self, r: Any):
        self.r = r
        self.single = cluster.scripts_reach_all(r)

    def journal(self, t: keys.Target) -> str:
        return keys.HIST_JOURNAL if self.single else keys.journal(t)

    def metrics(self, t: keys.Target) -> str:
        return keys.METRICS if self.single else keys.target_metrics(t)

    def run(self, calls: list[Call], touched: Iterable[keys.Target] = ()) -> list[Any]:
        """The calls' answers, in one pipeline; on Redis Cluster the targets they touched are named for the fold.

        A key of the wrong type (or a count that is not a number) among those the calls touch is repaired
        (service/repairs.py) and the calls are run once more: a script that failed part-way kept what it wrote
        before (Redis does not roll a script back), and what it decided then reads as decided already."""
        touched = list(touched)
        try:
            answers = run_scripts(self.r, calls)
        except redis.ResponseError as exc:
            if not repairs.fixable(exc):
                raise
            repairs.check_shared(self.r)
            repairs.check_targets(self.r, touched)
            answers = run_scripts(self.r, calls)
        if not self.single:
            labels = sorted({t.label for t in touched})
            if labels:
                self.r.sadd(keys.HIST_DIRTY, *labels)
        return answers


# Pairs per DECIDE_MANY call: one call holds Redis for the whole batch, so a 1,000-alert notification is
# cut into a few (all still in one pipeline, one round trip).
DECIDE_BATCH = 100


@dataclass(frozen=True)
class Decided:
    """DECIDE's answer for one pair: its status ('duplicate', 'stale', 'closed': no new record; 'reach': not
    decided, nothing written), the record it made or answered with, why, when the reconciler is first due at
    its target (ms; None for never), and whether the record was counted as its node's incident."""

    status: str
    record_id: str | None
    reason: str | None
    first_ms: int | None
    incident: bool = False

    @classmethod
    def of(cls, answer: Sequence[Any]) -> Decided:
        first = int(answer[3])
        return cls(str(answer[0]), str(answer[1]) or None, str(answer[2]) or None, None if first < 0 else first,
                   int(answer[4]) == 1)


def decide_many_calls(ks: Keyspace, made: list[NewRecord], index: bool) -> list[Call]:
    """DECIDE_MANY calls for pairs whose keys share one slot (all pairs, on a single Redis), in order; with
    index, each call also writes the approvals and due-target indexes of what it made."""
    calls: list[Call] = []
    for start in range(0, len(made), DECIDE_BATCH):
        chunk = made[start:start + DECIDE_BATCH]
        names: list[str] = []
        argv: list[Any] = [len(chunk), int(index)]
        for n in chunk:
            k, block = n.keys_block(ks.journal(n.target), ks.metrics(n.target))
            names += k
            argv.append(len(block))
            argv += block
        if index:
            names += [keys.APPROVALS, keys.DUE, keys.NODES_SEEN]
        calls.append((script("decide_many"), names, argv))
    return calls


def approve_call(ks: Keyspace, rid: str, *, verb: str, now: float, by: str, comment: str, signature: str,
                 send: str, expires_at: float, playbook: str, fingerprint: str, firing: bool, undo: bool,
                 obligation_due: float, episode_ttl: float, deadline_ms: int, early: Early = (),
                 defer: bool = False, incident: bool = False) -> Call:
    """The APPROVE call: release (verb approve), refuse (reject) or set aside (tamper) a held record (incident:
    once released, the record is its node's incident)."""
    t = keys.target_of_record(rid)
    args = {"now": int(now * 1000), "at": rfc3339(now), "verb": verb, "by": by, "comment": comment,
            "early": early_arg(early), "defer": int(defer), "signature": signature, "send": send,
            "expires_ms": int(expires_at * 1000), "undo": int(undo and firing),
            "ob_member": keys.obligation_member(playbook, fingerprint),
            "ob_due_ms": int((now + obligation_due) * 1000), "episode_ttl_ms": int(episode_ttl * 1000),
            "rid": rid, "holds": keys.episode_fields(playbook, fingerprint, "holds")[0], "deadline": deadline_ms,
            "kind": t.kind, "playbook": playbook, "incident": int(incident),
            "incident_window_ms": int(INCIDENT_WINDOW * 1000), "incident_keep_ms": int(INCIDENT_KEEP * 1000)}
    names = [keys.record(rid), keys.mailbox(t), keys.target_state(t), keys.obligation(t, playbook, fingerprint),
             keys.due_items(t), ks.journal(t), ks.metrics(t), keys.node_incidents(t), keys.node_incident_times(t)]
    return script("approve"), names, [dumps(args)]


@dataclass(frozen=True)
class Reconciled:
    """What RECONCILE did for one target."""

    next_due_ms: int | None
    changed: tuple[tuple[str, str], ...]
    obligations: tuple[str, ...]
    follow: tuple[str, ...] = ()

    @classmethod
    def of(cls, answer: Sequence[Any]) -> Reconciled:
        nxt, changed, obligations, follow = answer
        flat = [str(x) for x in changed]
        due = int(float(nxt))
        return cls(None if due < 0 else due, tuple(zip(flat[::2], flat[1::2])), tuple(map(str, obligations)),
                   tuple(map(str, follow)))


def reconcile_call(ks: Keyspace, target: keys.Target, now: float, *, grace: float, recheck: float,
                   keep: float, limit: int = 1000) -> Call:
    """The RECONCILE call that brings one target's records to the truth (see lua/reconcile.lua)."""
    args = {"now": int(now * 1000), "at": rfc3339(now), "grace_ms": int(grace * 1000),
            "recheck_ms": int(recheck * 1000), "rec_prefix": keys.record_prefix(target),
            "suffix": f"~{target.kind}~{target.name}", "limit": limit, "kind": target.kind,
            "keep_ms": int(keep * 1000)}
    return (script("reconcile"), [keys.due_items(target), keys.mailbox(target), keys.heartbeat(target),
                                  keys.target_state(target), ks.journal(target), ks.metrics(target)], [dumps(args)])


def deferred_call(ks: Keyspace, record_id: str, now: float, signature: str, send: str, expires_at: float,
                  early: Early, reason: str = "", results: Mapping[int, str] | None = None) -> Call:
    """Send a record's command after its conditions (see lua/deferred.lua). reason: the record's own, when it is
    set aside whole (tampered); results: the answer (JSON) of steps the service carried out itself."""
    t = keys.target_of_record(record_id)
    args = {"now": int(now * 1000), "at": rfc3339(now), "rid": record_id, "signature": signature, "send": send,
            "exp": int(expires_at * 1000), "early": early_arg(early), "reason": reason, "kind": t.kind,
            "results": {str(i): text for i, text in (results or {}).items()}}
    return (script("deferred"), [keys.record(record_id), keys.mailbox(t), keys.due_items(t), keys.target_state(t),
                                 ks.journal(t), ks.metrics(t)], [dumps(args)])


def verdict_call(ks: Keyspace, record_id: str, status: str, resolved_at: str | None = None,
                 time_to_resolve: float | None = None) -> Call:
    """Decide a pending outcome (see lua/verdict.lua); its answer is 1 when this call decided it."""
    args = {"status": status, "resolved_at": resolved_at or "", "rid": record_id,
            "time_to_resolve_s": -1 if time_to_resolve is None else round(time_to_resolve, 3)}
    t = keys.target_of_record(record_id)
    return script("verdict"), [keys.record(record_id), ks.journal(t)], [dumps(args)]


def breaker_call(op: str, playbook: str, now: float, members: list[str], limit: int, lease: float) -> Call:
    """A BREAKER call (see lua/breaker.lua): claim a place under the playbook's max_active, release places, or
    renew the leases of remediations still open."""
    args = {"op": op, "now": int(now * 1000), "members": members, "limit": limit, "lease_ms": max(1, int(lease * 1000))}
    return (script("breaker"), [keys.breaker_open(playbook), keys.breaker_state(playbook),
                                keys.breaker_targets(playbook)], [dumps(args)])


def mark_call(now: float) -> Call:
    """The MARK call (see lua/mark.lua)."""
    return script("mark"), [keys.MARK], [int(now * 1000)]


# Journal entries one TAKE moves at most (the rest at the next look).
TAKE_LIMIT = 10_000


def take_call(t: keys.Target) -> Call:
    """The TAKE of what a target's own scripts left for the service (see lua/take.lua)."""
    return script("take"), [keys.journal(t), keys.target_metrics(t)], [TAKE_LIMIT]
