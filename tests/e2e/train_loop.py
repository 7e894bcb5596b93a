"""A real PyTorch training loop on the CPU with a LambdaLR schedule and a RemediationClient (run as a subprocess).

Usage: train_loop.py JOB REDIS_URL OUT.json STOP_FILE [STEP_SECONDS] [MAX_STEPS]
Writes, per step, the optimizer's LR and the LR the untouched schedule would give.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from trainmedic.client import RemediationClient


def schedule(step: int) -> float:
    return 1.0 / (1.0 + 0.01 * step)


def main() -> None:
    job, url, out, stop = sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
    step_seconds = float(sys.argv[5]) if len(sys.argv) > 5 else 0.01
    max_steps = int(sys.argv[6]) if len(sys.argv) > 6 else 100_000
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    rows, applied = [], []
    with RemediationClient(job=job, redis_url=url, optimizer=opt, scheduler=sched) as rc:
        @rc.handler("rollback_checkpoint")
        def rollback(params: dict) -> dict:
            return {"restored_step": max(0, len(rows) - 10)}

        step = 0
        while step < max_steps and not stop.exists():
            t0 = time.perf_counter()
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            for ack in rc.poll(step=step):
                applied.append({"step": step, "action": ack.action, "status": ack.status, "time": time.time()})
            rows.append({"step": step, "lr": opt.param_groups[0]["lr"], "scheduled": 0.1 * schedule(step + 1)})
            step += 1
            time.sleep(max(0.0, step_seconds - (time.perf_counter() - t0)))
            if step % 50 == 0:
                out.write_text(json.dumps({"rows": rows, "applied": applied}))
    out.write_text(json.dumps({"rows": rows, "applied": applied, "done": True}))


if __name__ == "__main__":
    main()
