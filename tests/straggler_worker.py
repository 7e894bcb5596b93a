"""One gloo rank of a small data-parallel job with straggler detection (a subprocess of tests and benchmarks).

Run as `python -m tests.straggler_worker CONFIG_JSON`; trains until config["steps"] steps or until the file
config["stop"] exists (checked every 10 steps, the same step on every rank), then writes its findings as JSON
to config["out"]: on rank 0, every comparison's times and what the judge found after it.
"""
from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainmedic.client import RemediationClient


def watch(judge: Any, seen: list[list[float]]) -> None:
    """Keep the times of each comparison the judge is given (what the rank's findings show)."""
    compare = judge.compare

    def keeping(times: list[float]) -> bool:
        seen.append(list(times))
        return bool(compare(times))
    judge.compare = keeping


def main(cfg: dict[str, Any]) -> None:
    rank, world = cfg["rank"], cfg["world"]
    os.environ["TRAINMEDIC_NODE"] = cfg["nodes"][rank]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    comparisons: list[dict[str, Any]] = []
    detected_at: int | None = None
    with RemediationClient(job=cfg["job"], redis_url=cfg["redis_url"], heartbeat_interval=0.5,
                           detect=cfg.get("detect", True)) as rc:
        step = 0
        stop = Path(cfg["stop"]) if cfg.get("stop") else None
        started = time.perf_counter()
        seen: list[list[float]] = []  # rank 0: the times of each comparison, as the judge was given them
        for step in range(cfg["steps"]):
            x = torch.randn(32, 16, generator=gen)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            rc.poll(step=step)
            if step == 0:
                Path(cfg["out"] + ".started").touch()  # the test may slow a rank down from here on
                if rc._stragglers is not None:
                    watch(rc._stragglers, seen)
            judge = rc._stragglers
            if judge is not None and judge.compared > len(comparisons):
                comparisons.append({"step": step, "at": time.time(), "compared": judge.compared,
                                    "times": seen[-1] if seen else None,
                                    "found": [judge.found.rank, judge.found.ratio] if judge.found else None})
                if judge.found is not None and detected_at is None:
                    detected_at = judge.compared
            if stop is not None and step % 10 == 9:
                flag = torch.tensor([float(stop.exists())])
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank leaves at the same step
                if flag.item():
                    break
            if cfg.get("step_sleep"):
                time.sleep(cfg["step_sleep"])
        elapsed = time.perf_counter() - started
        Path(cfg["out"]).write_text(json.dumps({
            "rank": rank, "steps": step + 1, "seconds": elapsed, "comparisons": comparisons,
            "detected_at": detected_at, "detected": list(rc.detected)}))
        faulthandler.dump_traceback_later(60, exit=True)  # a hang below prints where and ends the rank
        dist.barrier()
    dist.barrier()
    # As tests/rank_worker.py: torch 2.13's gloo teardown can deadlock at exit under load; not the client's.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
