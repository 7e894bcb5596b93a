"""The `serve` and `agent` command lines the deployment files run, checked against trainmedic's own parser."""
from __future__ import annotations

import contextlib
import io
from collections.abc import Sequence

from trainmedic.service.cli import parser


def check_command(argv: Sequence[str]) -> None:
    """Raise AssertionError unless `trainmedic serve|agent ...` argv is one the CLI accepts."""
    assert argv[0].endswith("trainmedic"), argv
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parser().parse_args(list(argv[1:]))
    except SystemExit as exc:
        raise AssertionError(f"trainmedic's parser refuses {argv}: {err.getvalue().strip()}") from exc
