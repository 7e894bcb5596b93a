"""The Flask app: create_app() reads the settings, attaches Redis, playbooks and blueprints; nothing at import."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any
from collections.abc import Mapping

import redis
from flask import Flask, g, jsonify, request
from werkzeug.exceptions import HTTPException

from ..client.wire.redis import connect
from ..client.wire.signing import Signer

from . import upgrade
from .decide.alertmanager import Alertmanager
from .decide.detections import Detections
from .decide.dispatch import DispatchSettings, Dispatcher
from .decide.reconciler import Reconciler, ReconcilerSettings
from .errors import MAX_BODY, TrainmedicError
from .people import People
from .prometheus import Prometheus
from .rules.playbooks import SHIPPED, Playbook, load, missing_alertmanager
from .settings import ServiceSettings
from .store.scripts import load_scripts
from .web.metrics import WEBHOOK_SECONDS, Metrics

log = logging.getLogger("trainmedic.service")

# Connection trouble means "try again later" (503); any other Redis error is a bug (500).
REDIS_DOWN: tuple[type[Exception], ...] = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)
try:  # cluster-only errors
    from redis.exceptions import ClusterDownError, TryAgainError
    REDIS_DOWN = REDIS_DOWN + (ClusterDownError, TryAgainError)
except ImportError:  # pragma: no cover
    pass


@dataclass
class Extension:
    """What the app holds: the settings, a Redis client (a pool, no state) and the playbooks loaded at start."""

    settings: ServiceSettings
    redis: redis.Redis
    playbooks: list[Playbook]
    dispatcher: Dispatcher
    reconciler: Reconciler
    metrics: Metrics
    prometheus: Prometheus | None = None

    def playbook(self, name: str) -> Playbook | None:
        return next((p for p in self.playbooks if p.name == name), None)


def create_app(test_config: Mapping[str, Any] | None = None) -> Flask:
    """The Flask app: the environment's settings, then test overrides (ServiceSettings field names, or Flask's)."""
    app = Flask(__name__, static_folder="web/static")
    # Records answer in their documented field order, and unsorted encoding is a third cheaper on a history page.
    app.json.sort_keys = False  # type: ignore[attr-defined]  # DefaultJSONProvider has it
    settings = ServiceSettings.from_env()
    overrides = dict(test_config or {})
    fields = {k: overrides.pop(k) for k in list(overrides) if k in ServiceSettings.__dataclass_fields__}
    app.config.update(MAX_CONTENT_LENGTH=MAX_BODY, **overrides)
    init_app(app, settings.replace(**fields))
    return app


def public_url(settings: ServiceSettings) -> str:
    """TRAINMEDIC_PUBLIC_URL, else http://HOST:PORT as bound (links in silences and notifications)."""
    return settings.public_url or f"http://{settings.bind}"


def init_app(app: Flask, settings: ServiceSettings) -> None:
    """Attach Redis, playbooks, blueprints and error handlers (playbooks are validated here)."""
    if not settings.redis_url:
        raise ValueError("no Redis URL: set TRAINMEDIC_REDIS_URL (trainmedic serve starts an embedded Redis)")
    if not settings.signing_key:
        raise ValueError("no signing key: set TRAINMEDIC_SIGNING_KEY or TRAINMEDIC_SIGNING_KEY_FILE (trainmedic serve "
                         "makes one in its data dir)")
    people = People.from_settings(settings)  # a bad tokens file stops the start here, naming its line
    playbooks = load([settings.playbooks or str(SHIPPED)])
    r = connect(settings.redis_url, timeout=float(app.config.get("REDIS_TIMEOUT", 2.0)))
    am = (Alertmanager(settings.alertmanager_urls, trust_after=settings.alertmanager_trust_after)
          if settings.alertmanager_urls else None)
    problem = missing_alertmanager(playbooks, settings.alertmanager_urls)
    if problem:
        raise ValueError(problem)
    rs = ReconcilerSettings(history_max=settings.history_max, public_url=public_url(settings),
                            notify_url=settings.notify_url, hang_after=settings.hang_after,
                            resync_after=settings.resync_after)
    dispatcher = Dispatcher(r, Signer.from_secret(settings.signing_key), DispatchSettings(
        dry_run=settings.dry_run, alertmanager_poll=rs.alertmanager_poll if am else None,
        notify=bool(settings.notify_url)))
    prometheus = Prometheus(settings.prometheus_url) if settings.prometheus_url else None
    metrics = Metrics()
    detections = Detections(r, dispatcher, playbooks, am, settings.hang_after, rs.public_url,
                            on_outcomes=metrics.remediations)
    reconciler = Reconciler(r, dispatcher, playbooks, rs, alertmanager=am, prometheus=prometheus,
                            on_change=metrics.ended, detections=detections)
    try:
        reconciler.mark_epoch()
        load_scripts(r)  # trainers and agents may run the scripts, not load them
        upgrade.run(r, dispatcher.signer)
    except REDIS_DOWN as exc:  # the app still starts; the reconciler marks it when Redis is back
        log.warning("Redis unavailable at start: %s", exc)
    app.extensions["trainmedic"] = Extension(settings, r, playbooks, dispatcher, reconciler, metrics, prometheus)
    app.extensions["trainmedic.people"] = people

    from .web import register

    register(app)

    @app.before_request
    def _start_timer() -> None:
        g.t0 = time.perf_counter()

    @app.after_request
    def _observe(resp: Any) -> Any:
        if request.endpoint == "webhook.webhook":
            WEBHOOK_SECONDS.observe(time.perf_counter() - g.get("t0", time.perf_counter()))
        return resp

    @app.errorhandler(TrainmedicError)
    def _our_error(exc: TrainmedicError) -> Any:
        return jsonify({"error": exc.message}), exc.status

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException) -> Any:
        messages = {413: "the body is larger than 1024 KiB", 404: "no such endpoint",
                    405: "this method is not allowed here"}
        msg = messages.get(exc.code or 500) or (exc.description or exc.name).split(". ")[0].rstrip(".")
        resp = jsonify({"error": msg})
        # Keep the exception's own headers: a 405 must say which methods are allowed (RFC 9110).
        resp.headers.extend((k, v) for k, v in exc.get_headers() if k.lower() != "content-type")
        return resp, exc.code

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception) -> Any:
        if isinstance(exc, REDIS_DOWN):
            log.warning("Redis unavailable: %s", exc)
            return jsonify({"error": "Redis is unavailable; try again"}), 503
        log.exception("unexpected error on %s %s", request.method, request.path)
        return jsonify({"error": "internal error; see the service log"}), 500
