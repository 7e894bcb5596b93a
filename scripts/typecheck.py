"""mypy over the installed names: strict on trainmedic.client, the default checks on trainmedic.service.

The repository's top-level folders install as trainmedic.client and trainmedic.service through the links in
src/trainmedic/ (pyproject's package-dir). Inside them every import of the other folder is relative (`from
..client.wire import keys`), so the tree itself shows which folder uses which; mypy reads them from src/ by
the names they install under.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    env = {**os.environ, "MYPYPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
           "-p", "trainmedic.client", "-p", "trainmedic.service"]
    return subprocess.call(cmd, cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main())
