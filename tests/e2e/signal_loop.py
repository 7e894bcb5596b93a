"""A real PyTorch training loop on the CPU that passes its loss to poll() and goes wrong on purpose.

Usage: signal_loop.py JOB REDIS_URL OUT_PREFIX STOP_FILE MODE AT [WORLD] [STEP_SECONDS] [CLEAR_AFTER]
MODE: normal (nothing goes wrong), nan (the loss of rank WORLD-1 is NaN at step AT), spike (a corrupt data
shard from step AT: targets 30 times larger), hang (at step AT the loop blocks on a lock until STOP_FILE.go
exists, while the client's threads go on). Each rank writes OUT_PREFIX-RANK.json: per step its time and LR,
and the acks poll() returned.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainmedic.client import RemediationClient


def run(rank: int, world: int, argv: list[str]) -> None:
    job, url, prefix, stop = argv[0], argv[1], argv[2], Path(argv[3])
    mode, at = argv[4], int(argv[5])
    step_seconds = float(argv[7]) if len(argv) > 7 else 0.02
    clear_after = int(argv[8]) if len(argv) > 8 else 20
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    w = torch.randn(8, 1, generator=gen)
    rows: list[list[float]] = []
    applied: list[dict] = []
    out = Path(f"{prefix}-{rank}.json")
    gate = threading.Lock()
    with RemediationClient(job=job, redis_url=url, optimizer=opt, heartbeat_interval=1.0,
                           detect={"clear_after": clear_after}) as rc:
        step = 0
        while not stop.exists():
            t0 = time.perf_counter()
            x = torch.randn(32, 8, generator=gen)
            y = x @ w + 0.3 * torch.randn(32, 1, generator=gen)
            if mode == "spike" and step >= at:
                y = y * 30  # a corrupt shard: the loss jumps far above its median
            loss = torch.nn.functional.mse_loss(model(x), y)
            value = loss.item()
            if mode == "nan" and step == at and rank == world - 1:
                value = float("nan")
            else:
                opt.zero_grad()
                loss.backward()
                opt.step()
            if mode == "hang" and step == at:
                gate.acquire()
                go = Path(str(stop) + ".go")
                while not gate.acquire(timeout=0.2):  # blocked, as on a lock nobody releases
                    if go.exists() or stop.exists():
                        break
            for ack in rc.poll(step=step, loss=value):
                applied.append({"step": step, "action": ack.action, "status": ack.status, "time": time.time()})
            rows.append([step, time.time(), opt.param_groups[0]["lr"], value])
            step += 1
            if step % 25 == 0:
                out.write_text(json.dumps({"rows": rows, "applied": applied}))
            time.sleep(max(0.0, step_seconds - (time.perf_counter() - t0)))
        out.write_text(json.dumps({"rows": rows, "applied": applied, "done": True}))
    if world > 1:
        dist.destroy_process_group()


def main() -> None:
    argv = sys.argv[1:]
    world = int(argv[6]) if len(argv) > 6 else 1
    if world == 1:
        run(0, 1, argv)
        return
    import torch.multiprocessing as mp

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    mp.spawn(run, args=(world, argv), nprocs=world)


if __name__ == "__main__":
    main()
