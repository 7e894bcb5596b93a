"""`trainmedic test PATH... [--junit PATH]`: run playbook tests (*.test.yaml) through the service's own
decisions on a scratch Redis and a virtual clock."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..settings import ServiceSettings
from .common import CliError, need


def add(sub: Any) -> None:
    t = sub.add_parser("test", help="run playbook tests: exit 0 all passed, 1 one failed, 2 invalid test files")
    t.add_argument("paths", nargs="+", metavar="PATH", help="test files, or folders of *.test.yaml")
    t.add_argument("--junit", metavar="PATH", help="also write the results as JUnit XML to PATH")
    t.set_defaults(run=run)


def run(args: argparse.Namespace, settings: ServiceSettings) -> int:
    need("test", "yaml")
    from ..playtest.engine import EngineError
    from ..playtest.scratch import scratch
    from ..playtest.report import junit
    from ..playtest.suite import run_file
    from ..playtest.testfile import read, test_files

    files, problems = test_files(args.paths)
    parsed = []
    for path in files:
        tf, found = read(path)
        problems.extend(found)
        if tf is not None:
            parsed.append(tf)
    if problems:
        for line in problems:
            print(line)
        return 2
    results = []
    try:
        with scratch() as r:
            for tf in parsed:
                for result in run_file(r, tf):
                    results.append(result)
                    print(f"{result.where}: test {result.name}: {'ok' if result.ok else 'FAILED'}", flush=True)
                    for line in result.problems:
                        print(f"  {line}")
    except EngineError as exc:
        raise CliError(str(exc)) from None
    failed = sum(not r.ok for r in results)
    print(f"{len(results) - failed} of {len(results)} test{'s' * (len(results) != 1)} passed "
          f"({len(parsed)} file{'s' * (len(parsed) != 1)})")
    if args.junit:
        try:
            Path(args.junit).write_bytes(junit(results))
        except OSError as exc:
            raise CliError(f"cannot write {args.junit}: {exc.strerror or exc}", 2) from None
    return 1 if failed else 0
