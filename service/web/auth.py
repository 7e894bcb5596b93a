"""Bearer-token auth for write endpoints, compared in constant time."""
from __future__ import annotations

import functools
import hmac
import ipaddress
from typing import Any, Callable

from flask import current_app, request

from trainmedic.service.errors import Forbidden, Unauthorized


def _loopback(addr: str | None) -> bool:
    try:
        return addr is not None and ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def check() -> None:
    """Raise unless the request may write: the right bearer token, or loopback when no token is set."""
    token = current_app.config.get("WEBHOOK_TOKEN")
    if not token:
        if not _loopback(request.remote_addr):
            raise Forbidden("no webhook token is configured, so writes are accepted from loopback only")
        return
    header = request.headers.get("Authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise Unauthorized("this endpoint needs an Authorization: Bearer token")
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise Unauthorized("the bearer token is wrong")


def write_endpoint(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator for POST handlers: auth before anything else."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        check()
        return fn(*args, **kwargs)
    return wrapper
