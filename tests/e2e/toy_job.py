"""A real PyTorch training loop on the CPU that exports its loss for Prometheus and obeys trainmedic.

Usage: toy_job.py JOB REDIS_URL METRICS_PORT OUT.json MODE
MODE says when its loss is high ("diverging"), the way a too-high learning rate makes a run diverge:
  halve-once   while the LR is above 0.6x the starting LR: one halving fixes it
  halve-twice  while the LR is above 0.3x the starting LR: it takes two halvings
  stuck        always: no LR change helps; only stop_training ends it
The loss is the model's real MSE, plus 10 while diverging. stop_training ends the process (exit 0) after
writing OUT.json: the acks it applied and its LR over time.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from prometheus_client import Gauge, start_http_server

from trainmedic.client import RemediationClient

LOSS = Gauge("training_loss", "Training loss (toy).", ["job_name"])
LR = Gauge("training_learning_rate", "Learning rate of the first parameter group.", ["job_name"])
LIMITS = {"halve-once": 0.6, "halve-twice": 0.3, "stuck": 0.0}
LR0 = 0.1


def main() -> None:
    job, url, port, out, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]), sys.argv[5]
    start_http_server(port, addr="127.0.0.1")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=LR0)
    x, y = torch.randn(256, 8), torch.randn(256, 1)
    applied, lrs, stop = [], [], []
    # The loss reaches the service's /metrics through poll(); the tests that run this job raise its alerts
    # themselves, so the in-loop detectors stay off.
    with RemediationClient(job=job, redis_url=url, optimizer=opt, detect=False) as rc:
        @rc.handler("stop_training")
        def stop_training(params: dict) -> dict:
            stop.append(time.time())
            return {"stopping": True}

        @rc.handler("save_checkpoint")
        def save(params: dict) -> dict:
            return {"path": f"/tmp/{job}-checkpoint.pt"}

        step = 0
        while not stop:
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            lr = opt.param_groups[0]["lr"]
            diverging = mode == "stuck" or lr > LIMITS[mode] * LR0
            LOSS.labels(job).set(float(loss) + (10.0 if diverging else 0.0))
            LR.labels(job).set(lr)
            for ack in rc.poll(step=step, loss=float(loss)):
                applied.append({"step": step, "action": ack.action, "status": ack.status, "time": time.time()})
            if step % 20 == 0:
                lrs.append({"step": step, "lr": lr, "time": time.time()})
            step += 1
            time.sleep(0.02)
    out.write_text(json.dumps({"applied": applied, "lrs": lrs, "stopped_at": stop[0]}))


if __name__ == "__main__":
    main()
