"""Lemon nodes: the firing remediations dispatched to each node, counted for trainmedic_node_incidents_total
(config/rules/trainmedic.yml raises NodeLemon from it) and kept for 7 days for GET /targets.

The scripts that dispatch a record count it, in the node's hash slot (lua/common.lua count_incident): DECIDE for
a record dispatched at once, APPROVE for a held one once a person releases it. A record counts when it is a
firing record of a node target that was dispatched (no_live_target included) and did not end skipped at once;
dry runs, skips, holds, on_resolved records and the lemon-node playbook's own records never count. The service
notes each node it sees (an agent's heartbeat, an incident) in keys.NODES_SEEN, so that the node's series exist
at 0 before its first incident and that incident is an increase.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from ..client.wire import keys
from ..client.wire.status import Mode

from . import repairs

# The playbook that answers NodeLemon: its own drains are no new failure of the node.
LEMON_PLAYBOOK = "lemon-node"
# How far back GET /targets counts a node's incidents.
WINDOW = 7 * 86400.0
# A node neither heard from nor given an incident for this long loses its series; its counts go this long after
# its last incident (a counter that restarts at 0, which Prometheus's increase() reads as a reset).
FORGET_AFTER = 30 * 86400.0


def counts_as_incident(kind: str, mode: str, playbook: str) -> bool:
    """Whether a record of this target kind, mode and playbook is its node's incident once dispatched."""
    return kind == "node" and mode == Mode.FIRING and playbook != LEMON_PLAYBOOK


def seen(pipe: Any, nodes: Iterable[str], now: float) -> None:
    """Note nodes the service saw (on a pipeline the caller executes)."""
    names = {n: now for n in nodes if n}
    if names:
        pipe.zadd(keys.NODES_SEEN, names)


def counts(r: Any, playbooks: Iterable[str], now: float | None = None) -> dict[tuple[str, str], int]:
    """(node, playbook) -> incidents ever, for every node seen within FORGET_AFTER: 0 for each of `playbooks`
    (the node playbooks that count) until it has one, and whatever other playbook a node's count names."""
    now = time.time() if now is None else now
    pipe = r.pipeline(transaction=False)
    pipe.zremrangebyscore(keys.NODES_SEEN, "-inf", now - FORGET_AFTER)
    pipe.zrange(keys.NODES_SEEN, 0, -1)
    nodes = [str(n) for n in pipe.execute()[1] if keys.TARGET_NAME_RE.match(str(n))]
    pipe = r.pipeline(transaction=False)
    for node in nodes:
        pipe.hgetall(keys.node_incidents(keys.Target("node", node)))
    out: dict[tuple[str, str], int] = {}
    base = [p for p in playbooks if p != LEMON_PLAYBOOK]
    bad = 0
    for node, held in zip(nodes, pipe.execute(raise_on_error=False)):
        for pb in base:
            out[(node, pb)] = 0
        if isinstance(held, Exception):  # a key of another type: the next script to count there repairs it
            bad += 1
            continue
        for pb, n in held.items():
            if not str(n).isdigit() or not 0 < len(str(pb)) <= 200:
                bad += 1
            elif pb != LEMON_PLAYBOOK:
                out[(node, str(pb))] = int(n)
    if bad:
        repairs.note(r, "node incident counts that were not counts: left out", bad)
    return out


def recent(r: Any, nodes: Iterable[str], now: float | None = None) -> Mapping[str, int]:
    """Each node's incidents within the last WINDOW."""
    now = time.time() if now is None else now
    names = list(dict.fromkeys(nodes))
    if not names:
        return {}
    pipe = r.pipeline(transaction=False)
    for node in names:
        pipe.zcount(keys.node_incident_times(keys.Target("node", node)), f"({int((now - WINDOW) * 1000)}", "+inf")
    return {node: n if isinstance(n, int) else 0 for node, n in zip(names, pipe.execute(raise_on_error=False))}
