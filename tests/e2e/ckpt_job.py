"""A real one-process PyTorch training loop that saves a checkpoint file when trainmedic asks (a subprocess).

Usage: ckpt_job.py JOB REDIS_URL OUT.json STOP_FILE CKPT_DIR MODE
Its node is TRAINMEDIC_NODE from the environment, as on a cluster. MODE:
  train  steps until STOP_FILE exists; save_checkpoint writes CKPT_DIR/JOB-step-N.pt (slowly, as a real save of
         a large model is: a drain that did not wait for it would show)
  hang   steps a few times, then its loop hangs (as in a stuck collective): its heartbeat goes on, its steps
         and polls do not
Writes OUT.json with the checkpoints it saved, each with the step it was taken at.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from trainmedic.client import RemediationClient

SAVE_SECONDS = 1.0


def main() -> None:
    job, url, out, stop, ckpt_dir, mode = sys.argv[1:7]
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    saves: list[dict] = []
    with RemediationClient(job=job, redis_url=url, optimizer=opt, heartbeat_interval=0.3) as rc:
        @rc.handler("save_checkpoint")
        def save(params: dict) -> dict:
            path = Path(ckpt_dir) / f"{job}-step-{rc.step}.pt"
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": rc.step}, path)
            time.sleep(SAVE_SECONDS)
            saves.append({"step": rc.step, "path": str(path), "time": time.time()})
            Path(out).write_text(json.dumps({"saves": saves}))
            return {"path": str(path), "step": rc.step}

        step = 0
        while not Path(stop).exists():
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if mode == "train" or step < 5:
                rc.poll(step=step)
                step += 1
            time.sleep(0.02)
    Path(out).write_text(json.dumps({"saves": saves, "step": step, "done": True}))


if __name__ == "__main__":
    main()
