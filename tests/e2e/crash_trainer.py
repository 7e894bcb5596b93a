"""A real PyTorch training process with a RemediationClient that can die at the worst moment (run as a subprocess).

Usage: crash_trainer.py JOB REDIS_URL OUT.json MODE RECORD_ID STOP_FILE

MODE die:   train without polling until the client's inbox holds a claimed command (RECORD_ID's, or any when
            it is empty): the claim is in Redis, nothing was applied. Write {"pid", "killed_at"} to OUT and
            SIGKILL itself (a crash in the middle of a long step: no close(), no release, no ack).
MODE apply: train and poll every step; write {"pid", "offered_at": {rid: when the command reached the inbox},
            "applied": [{rid, action, status, step, at}]} to OUT after every step that applied something, and
            exit when STOP_FILE exists.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

from trainmedic.client import RemediationClient
from trainmedic.client.receiver.mailbox import Entry


def write(out: Path, data: dict) -> None:
    tmp = out.with_suffix(".writing")
    tmp.write_text(json.dumps(data))
    tmp.replace(out)


def main() -> None:
    job, url, out, mode, rid, stop = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4], sys.argv[5], \
        Path(sys.argv[6])
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    rc = RemediationClient(job=job, redis_url=url, optimizer=opt, heartbeat_interval=1.0)
    inbox = rc._inbox
    assert inbox is not None
    state: dict = {"pid": os.getpid(), "offered_at": {}, "applied": []}
    step = 0
    while not stop.exists():
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        waiting = [e.command.record_id for e in list(inbox.ready) if isinstance(e, Entry) and e.command is not None]
        if mode == "die":
            if waiting and (not rid or rid in waiting):
                write(out, {"pid": os.getpid(), "killed_at": time.time(), "held": waiting})
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.002)
            continue
        for w in waiting:
            state["offered_at"].setdefault(w, time.time())
        acks = rc.poll(step=step)
        for a in acks:
            state["applied"].append({"rid": a.record_id, "action": a.action, "status": a.status, "step": step,
                                     "at": time.time()})
        if acks or (waiting and step % 10 == 0):
            write(out, state)
        time.sleep(0.005)
    write(out, state)
    rc.close()


if __name__ == "__main__":
    main()
