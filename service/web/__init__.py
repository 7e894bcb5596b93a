"""The HTTP side: blueprints for the webhook, the API, the pages, metrics and OpenAPI, and the checks
every request passes (Host allowlist, Origin on writes, security headers on pages)."""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import redis
from flask import Flask

from .. import repairs
from . import api, auth, jobs, metrics, openapi, ui, webhook


def register(app: Flask) -> None:
    """Attach every blueprint and the request checks to the app."""
    app.jinja_environment = ui.PageEnvironment  # before the blueprints' filters create the environment
    for module in (webhook, api, jobs, metrics, ui, openapi):
        app.register_blueprint(module.bp)
    for endpoint, view in list(app.view_functions.items()):
        app.view_functions[endpoint] = _repaired(app, view)
    auth.install(app)


def _repaired(app: Flask, view: Callable[..., Any]) -> Callable[..., Any]:
    """The view, answered once more after a repair when a key it read held something trainmedic never wrote
    (a wrong type, a count that is not a number): never a 5xx for what is in Redis."""
    @functools.wraps(view)
    def answer(*args: Any, **kwargs: Any) -> Any:
        try:
            return view(*args, **kwargs)
        except redis.ResponseError as exc:
            if not repairs.fixable(exc):
                raise
            r = app.extensions["trainmedic"].redis
            repairs.check_shared(r)
            repairs.check_targets(r, repairs.targets_in(exc))
            return view(*args, **kwargs)
    return answer
