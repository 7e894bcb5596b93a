"""`trainmedic agent`: the node agent that applies host actions (GPU power limit, disk cleanup, drains)."""
from __future__ import annotations

import logging
import os
import signal
from typing import Any
from collections.abc import Sequence

from ..wire.signing import Verifier
from .daemon import Agent
from .scheduler import NONE as NO_SCHEDULER, Scheduler

__all__ = ["Agent", "run_agent"]


def run_agent(node: str, url: str, allow_roots: Sequence[str | os.PathLike[str]] = (), dry_run: bool = False, *,
              state_dir: str | os.PathLike[str], verifier: Verifier | None,
              scheduler: Scheduler = NO_SCHEDULER, slurm_node: str | None = None) -> int:
    """Run the agent until SIGTERM or SIGINT; raises ValueError (one sentence) for a bad node, root or state dir."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s trainmedic-agent %(levelname)s %(message)s")
    agent = Agent(node, url, allow_roots, dry_run, state_dir=state_dir, verifier=verifier, scheduler=scheduler,
                  slurm_node=slurm_node)

    def stop(signum: int, frame: Any) -> None:
        agent.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    agent.serve()
    return 0
