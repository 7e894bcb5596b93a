"""A real training loop in the test's own process, for client tests: it records how long each poll took."""
from __future__ import annotations

import time
from typing import Any

import torch

from trainmedic.client import RemediationClient


class Loop:
    """A real (tiny) training loop, SGD at 0.1 on a constant schedule, polling the client every step; it records
    how long each poll took and every ack (an exception out of poll() fails the test that drives it)."""

    def __init__(self, url: str, job: str, optimizer: bool = True, **kw: Any):
        self.param = torch.nn.Parameter(torch.ones(3))
        self.opt = torch.optim.SGD([self.param], lr=0.1)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda e: 1.0)
        kw = {"heartbeat_interval": 0.2, "max_backoff": 0.3, "redis_timeout": 0.5, **kw}
        self.rc = RemediationClient(job=job, redis_url=url, optimizer=self.opt if optimizer else None,
                                    scheduler=self.sched if optimizer else None, **kw)
        self.t = 0
        self.slowest = 0.0
        self.acks: list = []

    def tick(self) -> None:
        (self.param ** 2).sum().backward()
        self.opt.step()
        self.opt.zero_grad()
        self.sched.step()
        self.t += 1
        t0 = time.perf_counter()
        self.acks += self.rc.poll(step=self.t)  # an exception here fails the test: nothing may escape
        self.slowest = max(self.slowest, time.perf_counter() - t0)
        time.sleep(0.002)

    def run_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.tick()

    @property
    def lr(self) -> float:
        return self.opt.param_groups[0]["lr"]
