"""What the tests' gloo rank processes leave behind: each rank's log, and its findings once every rank ended."""
from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def rank_log(tmp: Path, name: str, rank: int) -> str:
    """The end of a rank's log."""
    return (tmp / f"{name}-{rank}.log").read_text()[-3000:]


def rank_results(procs: Sequence[subprocess.Popen[bytes]], tmp: Path, name: str, kill: Callable[[], None],
                 timeout: float = 120) -> list[dict[str, Any]]:
    """Each rank's findings (its NAME-RANK.json), once every rank exited 0; kill() first if one does not end."""
    deadline = time.monotonic() + timeout
    for rank, p in enumerate(procs):
        try:
            code = p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill()
            raise AssertionError(f"rank {rank} did not finish: {rank_log(tmp, name, rank)}") from None
        assert code == 0, f"rank {rank} exited {code}: {rank_log(tmp, name, rank)}"
    return [json.loads((tmp / f"{name}-{rank}.json").read_text()) for rank in range(len(procs))]
