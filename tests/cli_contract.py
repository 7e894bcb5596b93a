"""The `serve` and `agent` command lines the deployment files run, checked against the CLI.

Where trainmedic is installed, its own argument parser must accept the very argv a unit or the chart
runs. Where it is not (the deployment tests also run in a bare venv), the flags are checked against the
synopsis of CONTRACT.md's CLI section, copied here.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
from typing import Sequence

# CONTRACT.md, "CLI": the options of `serve` and `agent`, and which of them take a value.
CONTRACT_OPTIONS: dict[str, dict[str, bool]] = {
    "serve": {"--host": True, "--port": True, "--workers": True, "--redis-url": True, "--redis-port": True,
              "--playbooks": True, "--data-dir": True, "--no-agent": False, "--allow-root": True,
              "--dry-run": False},
    "agent": {"--node": True, "--redis-url": True, "--allow-root": True, "--state-dir": True,
              "--scheduler": True, "--slurm-node": True, "--dry-run": False, "--insecure-unsigned": False},
}
SCHEDULERS = {"slurm", "none"}


def _trainmedic_parser() -> argparse.ArgumentParser | None:
    if importlib.util.find_spec("trainmedic") is None:
        return None
    from trainmedic.service import cli

    return cli._parser()


def check_command(argv: Sequence[str]) -> None:
    """Raise AssertionError unless `trainmedic serve|agent ...` argv is one the CLI accepts."""
    assert argv[0].endswith("trainmedic"), argv
    command, args = argv[1], list(argv[2:])
    parser = _trainmedic_parser()
    if parser is not None:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                parser.parse_args([command, *args])
        except SystemExit as exc:
            raise AssertionError(f"trainmedic's parser refuses {argv}: {err.getvalue().strip()}") from exc
        return
    options = CONTRACT_OPTIONS[command]
    i = 0
    while i < len(args):
        flag = args[i]
        assert flag in options, f"{flag} is not an option of `trainmedic {command}` (CONTRACT.md CLI)"
        if options[flag]:
            assert i + 1 < len(args) and not args[i + 1].startswith("--"), f"{flag} needs a value in {argv}"
            if flag == "--scheduler":
                assert args[i + 1] in SCHEDULERS, args[i + 1]
            i += 2
        else:
            i += 1
    if command == "agent":
        assert "--node" in args, "agent needs --node"
