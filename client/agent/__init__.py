"""`trainmedic agent`: the node agent that applies host actions (GPU power limit, disk cleanup)."""
from __future__ import annotations

import logging
import os
import signal
from typing import Any, Sequence

from trainmedic.client.agent.daemon import Agent

__all__ = ["Agent", "run_agent"]


def run_agent(node: str, url: str, allow_roots: Sequence[str | os.PathLike] = (), dry_run: bool = False) -> int:
    """Run the agent until SIGTERM or SIGINT; raises ValueError for a bad node name or allow-root."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s trainmedic-agent %(levelname)s %(message)s")
    agent = Agent(node, url, allow_roots, dry_run)

    def stop(signum: int, frame: Any) -> None:
        agent.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    agent.serve()
    return 0
