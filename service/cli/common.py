"""What the service's `trainmedic` commands share: the service's API, and the basics every command shares
(trainmedic.client.cli)."""
from __future__ import annotations

from typing import Any

from ...client.cli import EXTRA_OF, CliError, Parser, UsageError, need

from ..settings import ServiceSettings

__all__ = ["EXTRA_OF", "CliError", "Parser", "UsageError", "need", "api", "operator_token", "read_token", "call"]


def api(settings: ServiceSettings, url: str | None, token: str | None = None) -> Any:
    """The service's HTTP API at --url (else TRAINMEDIC_URL), with the operator token when given."""
    from ..http import Http

    return Http(url or settings.url, token=token, timeout=10.0)


def operator_token(settings: ServiceSettings) -> str:
    """TRAINMEDIC_OPERATOR_TOKEN (or _FILE); people's writes need it."""
    if not settings.operator_token:
        raise CliError("set TRAINMEDIC_OPERATOR_TOKEN (or TRAINMEDIC_OPERATOR_TOKEN_FILE): `trainmedic serve` "
                       "prints it, and writes it into its data dir as operator.token")
    return settings.operator_token


def read_token(settings: ServiceSettings) -> str | None:
    """What reads send: TRAINMEDIC_READ_TOKEN, else the operator token, else none (reads may be open)."""
    return settings.read_token or settings.operator_token or None


def call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run an API call, turning its HttpError into the CLI's one-line error."""
    from ..http import HttpError

    try:
        return fn(*args, **kwargs)
    except HttpError as exc:
        raise CliError(exc.message, 2 if exc.status in (400, 404, 409, 415) else 1) from None
