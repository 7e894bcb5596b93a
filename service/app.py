"""trainmedic's service: the Alertmanager webhook, history and approvals (a Flask app run by gunicorn)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Mapping

import redis
from flask import Flask, g, jsonify, request
from werkzeug.exceptions import HTTPException

from trainmedic.client.wire.redis import connect

from trainmedic.service import config as config_mod
from trainmedic.service.decide.dispatch import Dispatcher, Settings
from trainmedic.service.errors import TrainmedicError
from trainmedic.service.web.metrics import WEBHOOK_SECONDS, Metrics
from trainmedic.service.rules.playbooks import Playbook, load

log = logging.getLogger("trainmedic.service")

# Connection trouble means "try again later" (503); any other Redis error is a bug (500).
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)
try:  # cluster-only errors
    from redis.exceptions import ClusterDownError, TryAgainError
    REDIS_DOWN = REDIS_DOWN + (ClusterDownError, TryAgainError)
except ImportError:  # pragma: no cover
    pass


@dataclass
class Extension:
    """What the app holds: a Redis client (a pool, no state) and the playbooks loaded at start."""

    redis: redis.Redis
    playbooks: list[Playbook]
    dispatcher: Dispatcher
    metrics: Metrics


def create_app(test_config: Mapping[str, Any] | None = None) -> Flask:
    """The Flask app: defaults, then TRAINMEDIC_* environment, then test overrides."""
    app = Flask(__name__)
    app.config.update(config_mod.from_env())
    if test_config:
        app.config.update(test_config)
    init_app(app)
    return app


def init_app(app: Flask) -> None:
    """Attach Redis, playbooks, blueprints and error handlers (playbooks are validated here)."""
    if not app.config.get("REDIS_URL"):
        raise ValueError("no Redis URL: set TRAINMEDIC_REDIS_URL (trainmedic serve starts an embedded Redis)")
    playbooks = load([app.config["PLAYBOOKS"]])
    r = connect(app.config["REDIS_URL"], timeout=float(app.config.get("REDIS_TIMEOUT", 2.0)))
    settings = Settings(dry_run=bool(app.config.get("DRY_RUN")))
    app.extensions["trainmedic"] = Extension(r, playbooks, Dispatcher(r, settings), Metrics())

    from trainmedic.service.web import api, metrics, openapi, ui, webhook
    for module in (webhook, api, metrics, ui, openapi):
        app.register_blueprint(module.bp)

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
