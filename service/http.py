"""Outbound HTTP, one way: requests with a timeout on every call and bounded retries.

The CLI talks to the service through it; the reconciler talks to Alertmanager, Prometheus and notification
hooks through it. Nothing here runs on the webhook's path.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import requests

DEFAULT_TIMEOUT = 5.0
# Retried: the connection failed, or the server said "try again" (Alertmanager and Prometheus answer 5xx
# while starting or overloaded). Never retried: any 4xx, which would fail the same way again.
RETRY_STATUSES = frozenset({502, 503, 504})


class HttpError(Exception):
    """A call that did not succeed; `message` is one sentence, `status` the HTTP status or None."""

    def __init__(self, message: str, status: int | None = None, body: Any = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.body = body


@dataclass
class Http:
    """A small client for one base URL: JSON in and out, a timeout on every call, a few retries."""

    base: str
    token: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    retries: int = 2
    backoff: float = 0.2
    session: requests.Session = field(default_factory=requests.Session, repr=False)
    on_401: str | None = None  # what its caller should do when the token is refused (the CLI names a variable)

    def url(self, path: str) -> str:
        # An empty path is the base itself (an incoming-webhook URL is posted to as it is).
        return self.base.rstrip("/") + "/" + path.lstrip("/") if path else self.base

    def get(self, path: str, params: dict | None = None) -> Any:
        """GET path; the decoded JSON body."""
        return self.request("GET", path, params=params)

    def post(self, path: str, body: Any = None) -> Any:
        """POST a JSON body to path; the decoded JSON answer."""
        return self.request("POST", path, body=body if body is not None else {})

    def delete(self, path: str) -> Any:
        """DELETE path; the decoded JSON answer (None when empty)."""
        return self.request("DELETE", path)

    def request(self, method: str, path: str, body: Any = None, params: dict | None = None) -> Any:
        """One call with up to `retries` more tries on connection errors and 502/503/504."""
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        data = None
        if body is not None:
            headers["Content-Type"] = "application/json"
            data = json.dumps(body, allow_nan=False)
        url = self.url(path)
        for attempt in range(self.retries + 1):
            try:
                resp = self.session.request(method, url, data=data, params=params, headers=headers,
                                            timeout=self.timeout)
            except requests.RequestException as exc:
                if attempt < self.retries:
                    time.sleep(self.backoff * 2 ** attempt)
                    continue
                raise HttpError(f"cannot reach {self.base}: {_why(exc)}") from None
            if resp.status_code in RETRY_STATUSES and attempt < self.retries:
                time.sleep(self.backoff * 2 ** attempt)
                continue
            return _answer(resp, method, url)
        raise AssertionError("unreachable")  # pragma: no cover

    def close(self) -> None:
        self.session.close()


def _answer(resp: requests.Response, method: str, url: str) -> Any:
    try:
        body = resp.json() if resp.content else None
    except ValueError:
        body = None
    if resp.ok:
        return body
    error = body.get("error") if isinstance(body, dict) else None
    reason = error or resp.reason or "error"
    raise HttpError(f"{method} {url}: HTTP {resp.status_code}: {reason}", resp.status_code, body)


def _why(exc: requests.RequestException) -> str:
    if isinstance(exc, requests.Timeout):
        return "no answer in time"
    if isinstance(exc, requests.ConnectionError):
        return "connection refused or unreachable"
    return type(exc).__name__
