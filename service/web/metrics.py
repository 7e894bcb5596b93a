"""Prometheus metrics, exact across gunicorn workers via prometheus_client's multiprocess mode.

Counters the service itself moves (alerts, remediations, webhook time) live in the worker processes and
are merged from PROMETHEUS_MULTIPROC_DIR. Acks are written by trainers and agents into their own target's
keys, which the service folds into the metrics hash (keys.METRICS, service/fold.py) as it looks at them, with
the counts its own scripts keep as records are dispatched and expire; a scrape reads that hash and the live
targets by kind (keys.live), so it costs the same with 10 targets or 10,000.
"""
from __future__ import annotations

import logging
import math
import os
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

import redis
from flask import Blueprint, Response, current_app
from prometheus_client import (CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Counter, Histogram,
                               generate_latest, multiprocess)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from ...client.wire import keys
from ...client.wire.scripts import ACK_LATENCY_BUCKETS

from .. import goodput_metrics, history, lemons, outcomes, repairs, unmatched
from ..fold import REJECT_REASONS
from ..rules.alerts import AlertGroup
from ..signals import metrics_text as training_signals

log = logging.getLogger("trainmedic.metrics")
bp = Blueprint("metrics", __name__)

ALERTS = Counter("trainmedic_alerts_received_total", "Alerts received on the webhook.", ["status"])
REMEDIATIONS = Counter("trainmedic_remediations_total", "Remediations decided, by playbook and status.",
                       ["playbook", "status"])
WEBHOOK_SECONDS = Histogram("trainmedic_webhook_duration_seconds", "Time to handle one webhook request.",
                            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))

ENDED = Counter("trainmedic_records_ended_total",
                "Records the reconciler ended (an action nobody acknowledged in time), by the record's final status.",
                ["status"])

class Metrics:
    """The service's counters, fed by the request handlers."""

    def webhook(self, group: AlertGroup, outcomes: Iterable) -> None:
        for a in group.alerts:
            ALERTS.labels(a.status).inc()
        self.remediations(outcomes)

    def ended(self, record_id: str, status: str) -> None:
        """The reconciler's on_change: count a record it ended."""
        ENDED.labels(status).inc()

    def remediations(self, outcomes: Iterable) -> None:
        for o in outcomes:
            if o.new:
                REMEDIATIONS.labels(o.playbook, o.status).inc()


class _Process(Collector):
    """This process's own registry, for a single-process server (no PROMETHEUS_MULTIPROC_DIR)."""

    def collect(self) -> Iterable[Metric]:
        return REGISTRY.collect()


class RedisCollector(Collector):
    """What lives in Redis: acks by action and status, ack latency, backlog, live targets, Redis health."""

    def __init__(self, r: redis.Redis, bounded: tuple[str, ...] = (), node_playbooks: tuple[str, ...] = ()):
        self.r = r
        # Playbooks with a max_active: trainmedic_breaker_open has a series for each.
        self.bounded = bounded
        # Playbooks that act on nodes: trainmedic_node_incidents_total has a series for each node seen and each.
        self.node_playbooks = node_playbooks

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("trainmedic_redis_up", "1 when Redis answered this scrape, 0 when it did not.")
        try:
            families = [*self._families(), self._unmatched(), self._breakers(), self._incidents()]
        except redis.RedisError as exc:
            # A scrape must still answer when Redis is down: that is when the gauge matters most.
            log.warning("metrics: Redis unavailable: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from families

    def _families(self) -> list[Metric]:
        now_ms = int(time.time() * 1000)
        pipe = self.r.pipeline(transaction=False)
        for kind in keys.TARGET_KINDS:
            pipe.zcount(keys.live(kind), f"({now_ms}", "+inf")
        pipe.zcard(keys.APPROVALS)
        pipe.hgetall(keys.REJECTED)
        pipe.get(keys.RESETS)
        pipe.get(keys.TAMPERED)
        pipe.get(keys.RESYNCED)
        pipe.get(keys.REPAIRS)
        pipe.hgetall(keys.METRICS)
        *counts, pending_approval, earlier_rejected, resets, tampered, resynced, repaired, stats = pipe.execute()
        live = dict(zip(keys.TARGET_KINDS, (int(n) for n in counts)))

        acked: dict[tuple[str, str], int] = defaultdict(int)
        buckets: dict[str, list[int]] = defaultdict(lambda: [0] * (len(ACK_LATENCY_BUCKETS) + 1))
        sums: dict[str, float] = defaultdict(float)
        backlog = {kind: 0 for kind in keys.TARGET_KINDS}
        rejected: dict[str, int] = defaultdict(int)
        # An earlier version counted refusals in a hash of their own.
        for reason, n in earlier_rejected.items():
            if reason in REJECT_REASONS and str(n).lstrip("-").isdigit():
                rejected[reason] += int(n)
        bad = _add_stats(stats, acked, buckets, sums, backlog, rejected)
        if bad:
            repairs.note(self.r, "fields of the metrics hash that were not counts", bad)
        # A keyspace that held dispatched records before these counts existed (an upgrade) may count below 0.
        backlog = {kind: max(0, n) for kind, n in backlog.items()}

        acked_f = CounterMetricFamily("trainmedic_actions_acked_total",
                                      "Actions acknowledged by trainers and agents, by action and status.",
                                      labels=["action", "status"])
        for (action, status), n in sorted(acked.items()):
            acked_f.add_metric([action, status], n)
        latency_f = HistogramMetricFamily("trainmedic_ack_latency_seconds",
                                          "Time from dispatch to the ack of an action, by action.",
                                          labels=["action"])
        for action, counts in sorted(buckets.items()):
            latency_f.add_metric([action], _cumulative(ACK_LATENCY_BUCKETS, counts), sums[action])
        backlog_f = GaugeMetricFamily("trainmedic_mailbox_backlog",
                                      "Commands not yet applied (waiting, or delivered and not acknowledged), by "
                                      "target kind.", labels=["kind"])
        live_f = GaugeMetricFamily("trainmedic_targets_live",
                                   "Training clients (job) and node agents (node) with a recent heartbeat.",
                                   labels=["kind"])
        for kind in keys.TARGET_KINDS:
            backlog_f.add_metric([kind], backlog[kind])
            live_f.add_metric([kind], live[kind])
        approvals_f = GaugeMetricFamily("trainmedic_approvals_pending", "Remediations waiting for approval.",
                                        value=int(pending_approval))
        rejected_f = CounterMetricFamily("trainmedic_commands_rejected",
                                         "Commands appliers refused (bad_signature, unsigned) or answered without "
                                         "applying again (replayed), as they reported through Redis.",
                                         labels=["reason"])
        for reason in REJECT_REASONS:
            rejected_f.add_metric([reason], rejected.get(reason, 0))
        resets_f = CounterMetricFamily("trainmedic_redis_resets",
                                       "Times Redis came back without trainmedic's data.", value=_count(resets))
        tampered_f = CounterMetricFamily("trainmedic_records_tampered",
                                         "Records the service refused to act on because their stored steps no "
                                         "longer matched what it decided.", value=_count(tampered))
        resynced_f = CounterMetricFamily("trainmedic_resynced",
                                         "Alerts the resync decided: Alertmanager listed them as active and Redis "
                                         "had no episode of them (writes lost in a crash, or an empty Redis).",
                                         value=_count(resynced))
        repairs_f = CounterMetricFamily("trainmedic_redis_repairs",
                                        "Keys of a wrong type or values that did not parse, that the service "
                                        "repaired or skipped.", value=_count(repaired))
        return [acked_f, latency_f, backlog_f, live_f, approvals_f, rejected_f, resets_f, tampered_f, resynced_f,
                repairs_f, *self._outcomes()]

    def _outcomes(self) -> list[Metric]:
        counts, hist = outcomes.counts(self.r)
        outcomes_f = CounterMetricFamily("trainmedic_remediation_outcomes",
                                         "Remediations by playbook and outcome (pending when applied, then "
                                         "effective or ineffective; unknown when nothing was applied).",
                                         labels=["playbook", "outcome"])
        for (playbook, outcome), n in sorted(counts.items()):
            outcomes_f.add_metric([playbook, outcome], n)
        resolve_f = HistogramMetricFamily("trainmedic_time_to_resolve_seconds",
                                          "Time from a remediation's last ack to its alert's end, by playbook.",
                                          labels=["playbook"])
        for playbook, (buckets, total, _) in sorted(hist.items()):
            resolve_f.add_metric([playbook], _cumulative(outcomes.RESOLVE_BUCKETS, buckets), total)
        return [outcomes_f, resolve_f]

    def _breakers(self) -> Metric:
        """trainmedic_breaker_open: 1 while a playbook's max_active holds back new remediations."""
        family = GaugeMetricFamily("trainmedic_breaker_open", "1 while the playbook's max_active holds back new "
                                   "remediations.", labels=["playbook"])
        if self.bounded:
            pipe = self.r.pipeline(transaction=False)
            for name in self.bounded:
                pipe.exists(keys.breaker_state(name))
            for name, is_open in zip(self.bounded, pipe.execute()):
                family.add_metric([name], 1 if is_open else 0)
        return family

    def _incidents(self) -> Metric:
        """trainmedic_node_incidents_total: firing remediations dispatched to each node, by playbook (Lemon nodes)."""
        family = CounterMetricFamily("trainmedic_node_incidents", "Firing remediations dispatched to each node, by "
                                     "playbook (0 from the first time trainmedic saw the node).",
                                     labels=["node", "playbook"])
        for (node, playbook), n in sorted(lemons.counts(self.r, self.node_playbooks).items()):
            family.add_metric([node, playbook], n)
        return family

    def _unmatched(self) -> Metric:
        counted = CounterMetricFamily("trainmedic_alerts_unmatched",
                                      "Alerts no playbook matched, by alert name (at most 100 names, then other).",
                                      labels=["alertname"])
        for name, n in sorted(unmatched.counts(self.r).items()):
            counted.add_metric([name], n)
        return counted


def _cumulative(bounds: tuple[float, ...], counts: list[int]) -> list[tuple[str, int]]:
    """Per-bucket counts (the last one past every bound) as Prometheus's cumulative (le, count) pairs."""
    out, running = [], 0
    for le, n in zip([*map(floatToGoString, bounds), "+Inf"], counts):
        running += n
        out.append((le, running))
    return out


def _count(text: Any) -> int:
    """A counter's value as Redis holds it (0 for none, or for what is not a whole number)."""
    try:
        return max(0, int(text or 0))
    except (TypeError, ValueError):
        return 0


def _add_stats(stats: dict[str, str], acked: dict, buckets: dict, sums: dict, backlog: dict,
               rejected: dict) -> int:
    """Fold the metrics hash (fields its folds and the service's scripts write) into the totals; how many fields
    did not read as counts."""
    bad = 0
    for field, value in stats.items():
        kind, _, rest = field.partition("|")
        try:
            if kind == "backlog" and rest in backlog:
                backlog[rest] += int(value)
            elif kind == "n":
                action, _, status = rest.partition("|")
                acked[(action, status)] += int(value)
            elif kind == "b":
                action, _, slot = rest.rpartition("|")
                buckets[action][len(ACK_LATENCY_BUCKETS) if slot == "inf" else int(slot)] += int(value)
            elif kind == "s":
                x = float(value)
                if not math.isfinite(x):
                    raise ValueError(value)
                sums[rest] += x
            elif kind == "rej" and rest in REJECT_REASONS:
                rejected[rest] += int(value)
            else:
                bad += 1
        except (ValueError, IndexError):
            bad += 1
    return bad


def registry_for(r: redis.Redis, bounded: tuple[str, ...] = (),
                 node_playbooks: tuple[str, ...] = ()) -> CollectorRegistry:
    """A registry for one scrape: every worker's counters (or this process's) plus what Redis holds (bounded:
    the playbooks with a max_active; node_playbooks: those that act on nodes)."""
    registry = CollectorRegistry()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        multiprocess.MultiProcessCollector(registry)
    else:
        registry.register(_Process())
    registry.register(RedisCollector(r, bounded, node_playbooks))
    return registry


@bp.get("/metrics")
def metrics() -> Response:
    """Prometheus text format: every worker's counters plus what Redis holds, and every job's training signals."""
    x = current_app.extensions["trainmedic"]
    r = x.redis
    try:
        # What the targets the service heard from (their acks) left in their own keys, counted first.
        history.catch_up(r, wait=0.2)
    except redis.RedisError:
        pass  # trainmedic_redis_up says so below
    body = generate_latest(registry_for(r, tuple(p.name for p in x.playbooks if p.max_active),
                                        tuple(p.name for p in x.playbooks if p.target == "node")))
    try:
        body += training_signals(r)
        body += goodput_metrics.metrics_text(r)
    except redis.RedisError as exc:  # trainmedic_redis_up says so already; the rest of the scrape still answers
        log.warning("metrics: training signals unavailable: %s", exc)
    return Response(body, mimetype=CONTENT_TYPE_LATEST)
