"""One rank of a real PyTorch training job on a known timeline, for the goodput accuracy test (a subprocess).

Run as `python -m tests.e2e.goodput_job CONFIG_JSON`. Config: job, redis_url, log (rank 0 writes one JSON line per
poll: its time and the step it passed, and when the client was made and closed), stop (a file: stop cleanly at the
next step once it exists), start_step, step_time, stall_at (the step at which the loop hangs stall_s seconds without
polling while its heartbeat goes on; null: none), heartbeat, and for a gloo job rank, world, port.
rollback_checkpoint goes back 100 steps (what restoring a checkpoint 100 steps old does to the step).
"""
from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from trainmedic.client import RemediationClient

BACK = 100


def main(cfg: dict) -> None:
    rank, world = cfg.get("rank", 0), cfg.get("world", 1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
    torch.manual_seed(0)
    model: torch.nn.Module = torch.nn.Linear(8, 1)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    log = open(cfg["log"], "a", buffering=1) if rank == 0 else None

    def note(**fields: object) -> None:
        if log is not None:  # a line at a time: a SIGKILL loses none of those written
            log.write(json.dumps({"t": time.time(), **fields}) + "\n")

    rc = RemediationClient(job=cfg["job"], redis_url=cfg["redis_url"], optimizer=opt,
                           heartbeat_interval=cfg["heartbeat"])
    note(event="created")
    state = {"step": cfg["start_step"]}

    @rc.handler("rollback_checkpoint")
    def rollback(params: dict) -> dict:
        state["step"] -= BACK
        return {"restored_step": state["step"]}

    stop = Path(cfg["stop"])
    stalled = False
    while True:
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        flag = torch.tensor([1.0 if stop.exists() else 0.0])
        if world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank stops at the same step
        if flag.item() > 0:
            break
        if not stalled and state["step"] == cfg.get("stall_at"):
            stalled = True
            note(event="stall")
            time.sleep(cfg["stall_s"])  # hung: no poll, the heartbeat thread goes on
        step = state["step"]
        rc.poll(step=step)
        note(step=step)
        state["step"] += 1  # after a rollback: the step after the one restored
        time.sleep(max(0.0, cfg["step_time"] - (time.perf_counter() - t0)))
    rc.close()
    note(event="closed")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
