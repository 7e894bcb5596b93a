"""Prometheus metrics, exact across gunicorn workers via prometheus_client's multiprocess mode."""
from __future__ import annotations

import os
from typing import Iterable

from flask import Blueprint, Response
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, REGISTRY,
                               generate_latest)
from prometheus_client import multiprocess

from .alerts import AlertGroup

bp = Blueprint("metrics", __name__)

ALERTS = Counter("trainmedic_alerts_received_total", "Alerts received on the webhook.", ["status"])
REMEDIATIONS = Counter("trainmedic_remediations_total", "Remediations decided, by playbook and status.",
                       ["playbook", "status"])
WEBHOOK_SECONDS = Histogram("trainmedic_webhook_duration_seconds", "Time to handle one webhook request.",
                            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))


class Metrics:
    """The service's counters, fed by the request handlers."""

    def webhook(self, group: AlertGroup, outcomes: Iterable) -> None:
        for a in group.alerts:
            ALERTS.labels(a.status).inc()
        self.remediations(outcomes)

    def remediations(self, outcomes: Iterable) -> None:
        for o in outcomes:
            if o.record_id and o.status != "duplicate":
                REMEDIATIONS.labels(o.playbook, o.status).inc()


@bp.get("/metrics")
def metrics() -> Response:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    else:
        registry = REGISTRY
    return Response(generate_latest(registry), mimetype=CONTENT_TYPE_LATEST)
