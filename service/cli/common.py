"""What the service's `trainmedic` commands share: the service's API, and the basics every command shares
(trainmedic.client.cli)."""
from __future__ import annotations

from typing import Any

from ...client.cli import EXTRA_OF, CliError, Parser, UsageError, need

from ..settings import ServiceSettings

__all__ = ["EXTRA_OF", "CliError", "Parser", "UsageError", "need", "api", "operator_token", "read_token", "call"]


def api(settings: ServiceSettings, url: str | None, token: str | None = None, writes: bool = False) -> Any:
    """The service's HTTP API at --url (else TRAINMEDIC_URL), with the token given: the operator token for a
    command that writes (then a 401 names TRAINMEDIC_OPERATOR_TOKEN), else the read token."""
    from ..http import Http

    return Http(url or settings.url, token=token, timeout=10.0, on_401=TOKEN_FOR_WRITES if writes else TOKEN_FOR_READS)


def operator_token(settings: ServiceSettings) -> str:
    """TRAINMEDIC_OPERATOR_TOKEN (or _FILE); people's writes need it."""
    if not settings.operator_token:
        raise CliError("set TRAINMEDIC_OPERATOR_TOKEN (or TRAINMEDIC_OPERATOR_TOKEN_FILE): `trainmedic serve` "
                       "prints it, and writes it into its data dir as operator.token")
    return settings.operator_token


def read_token(settings: ServiceSettings) -> str | None:
    """What reads send: TRAINMEDIC_READ_TOKEN, else the operator token, else none (reads may be open)."""
    return settings.read_token or settings.operator_token or None


# What to set when the service answers 401, for a read (GET) and for a write.
TOKEN_FOR_READS = ("set TRAINMEDIC_READ_TOKEN (or TRAINMEDIC_OPERATOR_TOKEN) to a token this service reads with: "
                   "its read token or an operator token")
TOKEN_FOR_WRITES = "set TRAINMEDIC_OPERATOR_TOKEN to an operator token of this service"


def call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run an API call, turning its HttpError into the CLI's one-line error (a 401 says which variable to set)."""
    from ..http import HttpError

    try:
        return fn(*args, **kwargs)
    except HttpError as exc:
        message = exc.message
        fix = getattr(getattr(fn, "__self__", None), "on_401", None)  # the api() this call went through
        if exc.status == 401 and fix:
            message = f"{message.rstrip('.')}: {fix}"
        raise CliError(message, 2 if exc.status in (400, 404, 409, 415) else 1) from None
