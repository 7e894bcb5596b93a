"""The service's small exception tree: each error carries its HTTP status and one human sentence."""
from __future__ import annotations

# The largest request body the service takes, however it is sent (Content-Length or chunked).
MAX_BODY = 1024 * 1024


class TrainmedicError(Exception):
    """Base error; `permanent` errors are never worth retrying."""

    status = 500
    permanent = True

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class BadRequest(TrainmedicError):
    status = 400


class Unauthorized(TrainmedicError):
    status = 401


class Forbidden(TrainmedicError):
    status = 403


class NotFound(TrainmedicError):
    status = 404


class Conflict(TrainmedicError):
    status = 409


class PayloadTooLarge(TrainmedicError):
    status = 413


class UnsupportedMediaType(TrainmedicError):
    status = 415


class Unavailable(TrainmedicError):
    """Redis is unreachable: Alertmanager retries 5xx, so nothing is lost."""

    status = 503
    permanent = False
