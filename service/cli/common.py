"""What every `trainmedic` command shares: the one-line error, the extras check, the service's API."""
from __future__ import annotations

import argparse
import importlib.util
import sys
from typing import Any, NoReturn

from ..settings import ServiceSettings

# Which extra brings each third-party module a command needs.
EXTRA_OF = {"flask": "service", "gunicorn": "service", "yaml": "service", "prometheus_client": "service",
            "requests": "agent", "cryptography": "agent"}


class CliError(Exception):
    """A one-line error for the user; the command exits with `code` (1 unless said otherwise)."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


class UsageError(CliError):
    """Bad usage or invalid input: exit code 2."""

    def __init__(self, message: str):
        super().__init__(message, 2)


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"trainmedic: {message} (see `{self.prog} --help`)\n")
        sys.exit(2)


def need(command: str, *modules: str) -> None:
    """Fail in one line when a module the command needs is missing, naming the extra that brings it."""
    for module in modules:
        if importlib.util.find_spec(module) is None:
            extra = EXTRA_OF.get(module, "service")
            raise CliError(f"`trainmedic {command}` needs the {extra} extra ({module} is not installed): "
                           f"pip install 'trainmedic[{extra}]'")


def api(settings: ServiceSettings, url: str | None, token: str | None = None) -> Any:
    """The service's HTTP API at --url (else TRAINMEDIC_URL), with the operator token when given."""
    from trainmedic.service.http import Http

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
    from trainmedic.service.http import HttpError

    try:
        return fn(*args, **kwargs)
    except HttpError as exc:
        raise CliError(exc.message, 2 if exc.status in (400, 404, 409, 415) else 1) from None
