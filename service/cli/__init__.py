"""The `trainmedic` command: serve, agent, check, send, history, show, jobs, match, approve, reject, test, replay,
--version."""
from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from ...client.settings import SettingsError

from ..settings import ServiceSettings
from ...client.agent import cli as agent

from . import approve, check, credentials, history, jobs, match, replay, send, serve, show, test
from .common import CliError, Parser

COMMANDS = (serve, agent, check, send, history, show, jobs, match, approve, credentials, test, replay)


def version() -> str:
    """`trainmedic X.Y.Z`, the installed distribution's version."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return f"trainmedic {dist_version('trainmedic')}"
    except PackageNotFoundError:
        return "trainmedic (not installed as a distribution)"


def parser() -> Parser:
    """The whole command line."""
    p = Parser(prog="trainmedic", description="Auto-remediation for ML training clusters.")
    p.add_argument("--version", action="version", version=version())
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    for module in COMMANDS:
        module.add(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; every failure is one line on stderr and a non-zero exit, never a traceback."""
    args = parser().parse_args(argv)
    try:
        # A command reads the settings it names (`agent`: the client's only), else the service's.
        settings = getattr(args, "reads", ServiceSettings).from_env()
        if args.command in ("serve", "agent"):
            # Long-running commands log as JSON lines; the others print for people.
            from ...client.logs import setup

            setup(settings.log_level)
        code: int = args.run(args, settings)
        return code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # Whoever read the output went away (`| head`): stop quietly, as other tools do, and keep Python's own
        # flush at exit from failing too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (CliError, SettingsError) as exc:
        sys.stderr.write(f"trainmedic: {exc}\n")
        return exc.code if isinstance(exc, CliError) else 2
