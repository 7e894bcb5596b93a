"""What a set of playbooks would have done with the alerts of a window: its episodes fed through the engine
as Alertmanager would have notified them, every target they name live, every command applied at once."""
from __future__ import annotations

import multiprocessing
import os
import time
import zlib
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Sequence

from ...client.wire import keys
from ...client.wire.protocol import rfc3339
from ...client.wire.status import RecordStatus

from ..decide.detections import fingerprint
from ..decide.dispatch import Outcome
from ..prometheus import Prometheus
from ..rules.playbooks import Playbook
from ..rules.targets import resolve
from .engine import Engine, EngineError, instant, ms
from .episodes import Episode, Window
from .outside import Answer, Live
from .scratch import captured, scratch

# Alertmanager's repeat_interval (its default): a firing alert is notified again this often, which keeps its
# resolve_timeout from running out while it fires.
REPEAT_INTERVAL = 4 * 3600.0
UNMATCHED = "unmatched"
# From this many episodes on, a replay runs in parts, in processes at once, where there are cores to spare: a
# part's run is mostly waits for Redis's answers, which processes overlap, but each part pays its own
# reconciler passes (one process makes one pass for every target due at an instant), so on two cores one
# process is faster.
PARALLEL_FROM = 1000


def workers_for(episodes: int) -> int:
    """How many processes replay this many episodes: half the cores, at most 8; one for a few episodes."""
    return 1 if episodes < PARALLEL_FROM else max(1, min(8, (os.cpu_count() or 1) // 2))


class AtTheTime(Prometheus):
    """`when:` conditions asked of the replayed Prometheus as of the replayed instant."""

    def __init__(self, url: str, clock: Callable[[], float]):
        super().__init__(url, timeout=10.0)
        self.clock = clock

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        return super().query(expr, self.clock() if at is None else at)


@dataclass
class Tally:
    """One playbook's decisions on the episodes it matched."""

    matched: int = 0
    dispatched: int = 0
    held: int = 0
    skipped: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        return {"matched": self.matched, "dispatched": self.dispatched, "held": self.held,
                "skipped": dict(sorted(self.skipped.items()))}


@dataclass(frozen=True)
class Replayed:
    """A replay of one set of playbooks: each playbook's tally (in the set's order), and each episode's decision
    for each target it was decided for (episode index, target label) -> dispatched | held | skipped/REASON."""

    tallies: dict[str, Tally]
    decisions: dict[tuple[int, str], str]
    seconds: float


def decision(o: Outcome) -> str:
    """What DECIDE answered for an episode's first notification, as replay reports it."""
    if o.status == RecordStatus.PENDING_APPROVAL:
        return "held"
    if o.status == RecordStatus.SKIPPED:
        return f"skipped/{o.reason or 'none'}"
    if o.status == RecordStatus.DRY_RUN:
        return "skipped/dry_run"
    if o.status in ("duplicate", "stale", "closed"):
        return f"skipped/{o.status}"
    return "dispatched"


def targets_of(episodes: Sequence[Episode]) -> list[Live]:
    """Every job and node the episodes' alerts name, live (a job on the node its alert names, if any)."""
    out: dict[keys.Target, Live] = {}
    for ep in episodes:
        node = resolve("node", ep.labels).target
        job = resolve("job", ep.labels).target
        if node is not None and node not in out:
            out[node] = Live(node)
        if job is not None and job not in out:
            out[job] = Live(job, node.name if node is not None else None)
    return list(out.values())


@dataclass(frozen=True)
class Shard:
    """Playbooks whose decisions depend on nothing outside the shard, with the episodes (their indexes) they
    match. Playbooks never affect each other, and one without max_active decides on each target on its own; a
    breaker (max_active) counts every target of its playbook, so such playbooks keep all of theirs."""

    playbooks: tuple[Playbook, ...]
    episodes: tuple[int, ...]


def shards(episodes: Sequence[Episode], playbooks: Sequence[Playbook], buckets: int) -> list[Shard]:
    """The playbooks' work in independent parts: the bounded playbooks with every episode they match, and the
    others by kind of target, their episodes split by target into `buckets` parts."""
    out = []
    bounded = tuple(pb for pb in playbooks if pb.max_active)
    if bounded:
        out.append(Shard(bounded, tuple(i for i, ep in enumerate(episodes)
                                        if any(pb.matches(ep.labels) for pb in bounded))))
    for kind in keys.TARGET_KINDS:
        free = tuple(pb for pb in playbooks if not pb.max_active and pb.target == kind)
        parts: list[list[int]] = [[] for _ in range(buckets)]
        for i, ep in enumerate(episodes):
            if any(pb.matches(ep.labels) for pb in free):
                t = resolve(kind, ep.labels).target
                parts[zlib.crc32(t.label.encode()) % buckets if t is not None else 0].append(i)
        out.extend(Shard(free, tuple(part)) for part in parts if part)
    return [x for x in out if x.episodes]


def replay(episodes: Sequence[Episode], playbooks: Sequence[Playbook], window: Window, prometheus_url: str,
           workers: int = 1, prune: bool = True) -> Replayed:
    """What the playbooks decide for the episodes: in this process, or in `workers` processes at once, each
    part of the work (shards) on its own scratch Redis, from an empty keyspace. Every target is live in every
    part, so a percent of live targets counts the same everywhere. prune: follow up only what can change a
    later decision (engine._Passes)."""
    began = time.perf_counter()
    live = targets_of(episodes)
    parts = shards(episodes, playbooks, workers) if workers > 1 else [
        Shard(tuple(playbooks), tuple(range(len(episodes))))]
    jobs = [(tuple(episodes[i] for i in part.episodes), part.playbooks, window, prometheus_url, tuple(live), prune)
            for part in parts]
    if workers > 1 and len(jobs) > 1:
        try:
            with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=multiprocessing.get_context("spawn")) as pool:
                done = list(pool.map(_shard, jobs))
        except BrokenProcessPool:
            raise EngineError("a replay process ended before its part was done (killed, or out of memory)") from None
    else:
        done = [_shard(job) for job in jobs]
    tallies = {pb.name: Tally() for pb in playbooks}
    decisions: dict[tuple[int, str], str] = {}
    for part, (got, made, errors) in zip(parts, done):
        if errors:
            raise EngineError(f"the service logged an error: {errors[0]}")
        for name, t in got.items():
            mine = tallies[name]
            mine.matched, mine.dispatched, mine.held = (mine.matched + t.matched, mine.dispatched + t.dispatched,
                                                        mine.held + t.held)
            mine.skipped.update(t.skipped)
        for (i, label), what in made.items():
            key = (part.episodes[i], label)
            decisions[key] = ", ".join(sorted([decisions[key], what])) if key in decisions else what
    return Replayed(tallies, decisions, time.perf_counter() - began)


def _shard(job: tuple[Sequence[Episode], Sequence[Playbook], Window, str, Sequence[Live], bool]
           ) -> tuple[dict[str, Tally], dict[tuple[int, str], str], list[str]]:
    """One part's replay on a scratch Redis of its own: tallies, decisions, and the service's logged errors."""
    episodes, playbooks, window, url, live, prune = job
    with scratch() as r, captured() as log:
        tallies, decisions = _run(r, episodes, playbooks, window, url, live, prune)
    return tallies, decisions, log.errors


def _run(r: Any, episodes: Sequence[Episode], playbooks: Sequence[Playbook], window: Window, prometheus_url: str,
         live: Sequence[Live], prune: bool = True) -> tuple[dict[str, Tally], dict[tuple[int, str], str]]:
    """Feed the episodes through the engine (from an empty keyspace) and tally what the playbooks decided (prune:
    follow up only the records whose follow-ups can change a later decision; see engine._Passes)."""
    r.flushall()
    conditions = AtTheTime(prometheus_url, lambda: window.start)
    engine = Engine(r, playbooks, live, instant(ms(window.start)), Answer.APPLIED, conditions,
                    followed=frozenset(pb.name for pb in playbooks if pb.escalate or pb.max_active) if prune else None)
    conditions.clock = lambda: engine.now
    prints = [fingerprint(ep.labels) for ep in episodes]
    # Each instant's notification: the episodes that begin (or are notified again), and those that resolve.
    firing: dict[int, list[int]] = {}
    again: dict[int, list[int]] = {}
    resolving: dict[int, list[int]] = {}
    for i, ep in enumerate(episodes):
        firing.setdefault(ms(ep.start), []).append(i)
        until = window.end if ep.end is None else ep.end
        at = ep.start + REPEAT_INTERVAL
        while at < until:
            again.setdefault(ms(at), []).append(i)
            at += REPEAT_INTERVAL
        if ep.end is not None:
            resolving.setdefault(ms(ep.end), []).append(i)
    tallies = {pb.name: Tally() for pb in playbooks}
    decisions: dict[tuple[int, str], str] = {}
    try:
        for at_ms in sorted(set(firing) | set(again) | set(resolving)):
            new = firing.get(at_ms, [])
            outcomes = engine.notify(instant(at_ms), [episodes[i].labels for i in new + again.get(at_ms, [])],
                                     [episodes[i].labels for i in resolving.get(at_ms, [])])
            by_print = {prints[i]: i for i in new}
            for o in outcomes:
                if o.fingerprint not in by_print or o.status in ("stale", "closed"):
                    continue  # a resend, or a resolve
                i = by_print[o.fingerprint]
                what = decision(o)
                tally = tallies[o.playbook]
                tally.matched += 1
                if what == "dispatched":
                    tally.dispatched += 1
                elif what == "held":
                    tally.held += 1
                else:
                    tally.skipped[what.split("/", 1)[1]] += 1
                label = keys.target_of_record(o.record_id).label if o.record_id else ""
                decisions[(i, label)] = f"{decisions[(i, label)]}, {what}" if (i, label) in decisions else what
        engine.advance(instant(ms(window.end)))
    finally:
        engine.close()
    return tallies, decisions


def changed(episodes: Sequence[Episode], before: Replayed, after: Replayed) -> list[dict[str, Any]]:
    """Each (episode, target) whose decision differs between two replays, by start."""
    out = []
    for i, label in sorted(set(before.decisions) | set(after.decisions), key=lambda k: (episodes[k[0]].start, k)):
        was, now = before.decisions.get((i, label), UNMATCHED), after.decisions.get((i, label), UNMATCHED)
        if was != now:
            ep = episodes[i]
            out.append({"alertname": ep.alertname, "target": label, "starts_at": rfc3339(ep.start),
                        "before": was, "after": now})
    return out
