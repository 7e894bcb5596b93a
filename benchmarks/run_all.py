"""Run every benchmark in this folder, one after the other, and print their figures."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SKIP = {"run_all.py", "common.py", "proc_cpu.py"}


def main() -> int:
    failed = 0
    for script in sorted(HERE.glob("*.py")):
        if script.name in SKIP or script.name.startswith("_"):
            continue
        print(f"\n== {script.name}", flush=True)
        failed += subprocess.run([sys.executable, str(script)], cwd=HERE).returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
