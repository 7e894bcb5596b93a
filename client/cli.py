"""What every `trainmedic` command shares, the node agent's among them: the one-line error, the command line
parser, the extras check. (The service's commands add theirs in trainmedic.service.cli.)"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from typing import NoReturn

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
