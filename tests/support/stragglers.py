"""A small gloo job of tests/straggler_worker.py ranks, one of them made slow by sharing its core with busy
processes (for the straggler tests and benchmarks/straggler_overhead.py)."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from trainmedic.service.embedded_redis import free_port
from tests.support.ranks import rank_log, rank_results

ROOT = Path(__file__).resolve().parents[2]
# A busy process: a Python loop that never sleeps.
BUSY = [sys.executable, "-c", "while True: pass"]


class StragglerJob:
    """`world` ranks of one job on node-0 ... node-(world-1), each on its own (named) node; `cores`: the CPUs
    each rank may run on (by rank; default: any)."""

    def __init__(self, tmp: Path, world: int, redis_url: str, job: str, cores: list[set[int]] | None = None,
                 **cfg: Any):
        self.tmp, self.world, self.job, self.cores = tmp, world, job, cores
        self.stop_file = tmp / f"{job}.stop"
        port = free_port()
        nodes = [f"node-{r}" for r in range(world)]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.helpers: list[subprocess.Popen[bytes]] = []
        for rank in range(world):
            conf = {"rank": rank, "world": world, "port": port, "redis_url": redis_url, "job": job, "nodes": nodes,
                    "out": str(tmp / f"{job}-{rank}.json"), "stop": str(self.stop_file), "steps": 10**9, **cfg}
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
            with open(tmp / f"{job}-{rank}.log", "wb") as log:
                self.procs.append(subprocess.Popen([sys.executable, "-m", "tests.straggler_worker", json.dumps(conf)],
                                                   cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
            if cores is not None:
                os.sched_setaffinity(self.procs[-1].pid, cores[rank])

    def started(self, timeout: float = 180) -> None:
        """Wait until every rank has trained a step (starting Python and torch takes long on a busy machine)."""
        deadline = time.monotonic() + timeout
        marks = [self.tmp / f"{self.job}-{rank}.json.started" for rank in range(self.world)]
        while not all(m.exists() for m in marks):
            for rank, p in enumerate(self.procs):
                assert p.poll() is None, f"rank {rank} exited {p.returncode}: {self.log(rank)}"
            assert time.monotonic() < deadline, "the ranks did not start training"
            time.sleep(0.1)

    def slow_down(self, rank: int, busy: int = 2, nice: int = 10) -> None:
        """Make `rank` share one core with `busy` busy-looping processes, at a lower priority than theirs."""
        core = max(os.sched_getaffinity(0))
        for tid in threads(self.procs[rank].pid):
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.sched_setaffinity(tid, {core})
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        for _ in range(busy):
            helper = subprocess.Popen(BUSY)
            os.sched_setaffinity(helper.pid, {core})
            self.helpers.append(helper)

    def restore(self, rank: int) -> None:
        """Give `rank` back its speed: the busy processes end, its priority and CPUs are what they were."""
        self.end_helpers()
        for tid in threads(self.procs[rank].pid):
            with contextlib.suppress(ProcessLookupError):
                os.setpriority(os.PRIO_PROCESS, tid, 0)
                os.sched_setaffinity(tid, self.cores[rank] if self.cores is not None else os.sched_getaffinity(0))

    def stop(self) -> None:
        """Ask the ranks to leave (at the same step), and end the busy processes."""
        self.stop_file.touch()
        self.end_helpers()

    def end_helpers(self) -> None:
        for h in self.helpers:
            if h.poll() is None:
                h.kill()
                h.wait()

    def results(self, timeout: float = 120) -> list[dict[str, Any]]:
        """Each rank's findings, once every rank has left."""
        return rank_results(self.procs, self.tmp, self.job, self.kill, timeout)

    def log(self, rank: int) -> str:
        return rank_log(self.tmp, self.job, rank)

    def kill(self) -> None:
        self.end_helpers()
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def threads(pid: int) -> list[int]:
    """Every thread of a process (Linux applies CPU affinity and nice to one thread at a time: torch's and gloo's
    threads would keep their own)."""
    return [int(name) for name in os.listdir(f"/proc/{pid}/task")]


# A playbook for TrainingStraggler that needs no scheduler: held, then an optional drain.
STRAGGLER_PLAYBOOK = """
playbooks:
  - name: straggler
    matchers: ['alertname="TrainingStraggler"']
    target: node
    approval: true
    actions:
      - drain_node: {reason: straggler}
        optional: true
"""
