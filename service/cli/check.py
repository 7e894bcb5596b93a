"""`trainmedic check [PATH]...`: validate playbook files; FILE:LINE: message per problem."""
from __future__ import annotations

import argparse
from typing import Any

from ..settings import ServiceSettings
from .common import need


def add(sub: Any) -> None:
    c = sub.add_parser("check", help="validate playbook files (exit 0 valid, 1 invalid)")
    c.add_argument("paths", nargs="*", metavar="PATH", help="playbook files or folders (default: the shipped ones)")
    c.set_defaults(run=run)


def run(args: argparse.Namespace, settings: ServiceSettings) -> int:
    need("check", "yaml")
    from ..rules.playbooks import SHIPPED, check, files_of, is_warning

    paths = args.paths or [settings.playbooks or str(SHIPPED)]
    playbooks, problems = check(paths)
    if not problems and not files_of(paths):
        problems = [f"{', '.join(paths)}: no playbook files (*.yaml) found"]
    errors = [p for p in problems if not is_warning(p)]
    for line in problems:
        print(line)
    if errors:
        return 1
    files = len(files_of(paths))
    print(f"ok: {len(playbooks)} playbook{'s' * (len(playbooks) != 1)} in {files} file{'s' * (files != 1)}")
    return 0
