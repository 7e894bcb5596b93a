"""The HTTP side: blueprints for the webhook, the API, the pages, metrics and OpenAPI, and the checks
every request passes (Host allowlist, Origin on writes, security headers on pages)."""
from __future__ import annotations

from flask import Flask

from . import api, auth, metrics, openapi, ui, webhook


def register(app: Flask) -> None:
    """Attach every blueprint and the request checks to the app."""
    app.jinja_environment = ui.PageEnvironment  # before the blueprints' filters create the environment
    for module in (webhook, api, metrics, ui, openapi):
        app.register_blueprint(module.bp)
    auth.install(app)
