"""mypy over the installed names: strict on trainmedic.client, the default checks on trainmedic.service.

The repository's top-level folders install as trainmedic.client and trainmedic.service (pyproject's
package-dir). Inside them every import of the other folder is relative (`from ..client.wire import keys`), so
the tree itself shows which folder uses which, and tools that read files as they lie follow it. Only the
package's own top name, trainmedic, exists nowhere on disk: mypy cannot follow setuptools' editable-install
import hook, so this links the folders under build/typecheck/trainmedic/ and checks them by those names.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FARM = ROOT / "build" / "typecheck"


def main() -> int:
    pkg = FARM / "trainmedic"
    pkg.mkdir(parents=True, exist_ok=True)
    for name in ("client", "service", "playbooks"):
        link = pkg / name
        if not link.is_symlink():
            link.symlink_to(ROOT / name, target_is_directory=True)
    env = {**os.environ, "MYPYPATH": str(FARM)}
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
           "-p", "trainmedic.client", "-p", "trainmedic.service"]
    return subprocess.call(cmd, cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main())
