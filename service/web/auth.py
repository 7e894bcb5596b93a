"""Who may do what: two bearer tokens, the Host allowlist, same-origin writes, headers on pages.

- The webhook token (Alertmanager's) is good for POST /webhook only. Without one, webhooks are taken from
  loopback only, and `serve` refuses to bind anything else.
- The operator token (people's) is for approve, reject, manual triggers and POST /commands. Without one,
  those answer 403: there is no loopback exception for people's writes (a local forwarder would defeat it).
- Every POST needs Content-Type application/json and refuses a foreign Origin, so no cross-site form
  reaches a write; a foreign Host gets 400, so DNS rebinding reaches nothing.
"""
from __future__ import annotations

import functools
import hmac
from typing import Any
from collections.abc import Callable
from urllib.parse import urlsplit

from flask import Flask, Response, request

from ..errors import BadRequest, Forbidden, Unauthorized
from ..hosts import host_only, loopback
from .common import ext

# Probes and scrapes answer any Host: load balancers and Prometheus address pods by IP.
ANY_HOST = ("/healthz", "/readyz", "/metrics")
HTML_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}


def _bearer() -> str | None:
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    return given.strip() if scheme.lower() == "bearer" and given.strip() else None


def _same(given: str, token: str | None) -> bool:
    return token is not None and hmac.compare_digest(given.encode(), token.encode())


def check_webhook() -> None:
    """Raise unless the request may post a webhook: the webhook token, or loopback when none is set."""
    settings = ext().settings
    if not settings.webhook_token:
        if not loopback(request.remote_addr):
            raise Forbidden("no webhook token is configured, so webhooks are accepted from loopback only")
        return
    given = _bearer()
    if given is None:
        raise Unauthorized("this endpoint needs an Authorization: Bearer token")
    if not _same(given, settings.webhook_token):
        raise Unauthorized("the bearer token is wrong")


def check_operator() -> str:
    """Raise unless the request carries the operator token; returns who acted ("operator")."""
    settings = ext().settings
    given = _bearer()
    if not settings.operator_token:
        raise Forbidden("no operator token is configured (TRAINMEDIC_OPERATOR_TOKEN), so people's writes are off")
    if given is None:
        raise Unauthorized("this endpoint needs an Authorization: Bearer token (the operator token)")
    if _same(given, settings.webhook_token) and not _same(given, settings.operator_token):
        raise Forbidden("the webhook token is for POST /webhook only; people's writes need the operator token")
    if not _same(given, settings.operator_token):
        raise Unauthorized("the bearer token is wrong")
    return "operator"


def webhook_endpoint(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator for POST /webhook: the webhook token before anything else."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        check_webhook()
        return fn(*args, **kwargs)
    return wrapper


def operator_endpoint(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator for people's writes: the operator token before anything else; the view gets `by`."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, by=check_operator(), **kwargs)
    return wrapper


def allowed_hosts() -> tuple[str, ...]:
    """TRAINMEDIC_ALLOWED_HOSTS, else the bound address and localhost."""
    settings = ext().settings
    if settings.allowed_hosts:
        return settings.allowed_hosts
    bound = settings.bind.rsplit(":", 1)[0].strip("[]").lower()
    return tuple(dict.fromkeys((bound, "localhost", "127.0.0.1", "::1")))


def _own_origins() -> set[str]:
    own = {f"{request.scheme}://{request.host}".lower()}
    public = ext().settings.public_url
    if public:
        parts = urlsplit(public)
        own.add(f"{parts.scheme}://{parts.netloc}".lower())
    return own


def _check_request() -> None:
    if request.path not in ANY_HOST and host_only(request.host) not in allowed_hosts():
        raise BadRequest("this service does not answer for that Host (see TRAINMEDIC_ALLOWED_HOSTS)")
    if request.method == "POST":
        origin = request.headers.get("Origin")
        if origin is not None and origin.lower() not in _own_origins():
            raise Forbidden("writes from another site's pages are refused (foreign Origin)")


def _headers(resp: Response) -> Response:
    if resp.mimetype == "text/html":
        for k, v in HTML_HEADERS.items():
            resp.headers.setdefault(k, v)
    return resp


def install(app: Flask) -> None:
    """Run the Host and Origin checks before every request, and add the page headers after."""
    app.before_request(_check_request)
    app.after_request(_headers)
