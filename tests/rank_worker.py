"""One gloo rank of a data-parallel training job with a RemediationClient and an untouched twin (a subprocess).

Run as `python -m tests.rank_worker CONFIG_JSON`; writes its findings as JSON to config["out"].
"""
from __future__ import annotations

import faulthandler
import json
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from trainmedic.client import RemediationClient

LRS = (0.1, 0.01)


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD([{"params": [model.weight], "lr": LRS[0]}, {"params": [model.bias], "lr": LRS[1]}],
                          lr=LRS[0], momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=20, T_mult=2)
    return model, opt, sched


def main(cfg: dict) -> None:
    rank, world = cfg["rank"], cfg["world"]
    if cfg.get("nodes"):  # each rank's own node, as each host of a multi-node job has its own
        os.environ["TRAINMEDIC_NODE"] = cfg["nodes"][rank]
    client_first = cfg.get("client_before_init", False) and rank == 0
    rc = None
    model, opt, sched = build(0)
    _, twin_opt, twin_sched = build(0)
    factors = [1.0] * len(LRS)
    start = 0
    if cfg.get("resume"):
        state = torch.load(f"{cfg['resume']}.{rank}", weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        twin_opt.load_state_dict(state["twin_opt"])
        twin_sched.load_state_dict(state["twin_sched"])
        factors, start = state["factors"], state["step"] + 1

    def client() -> RemediationClient:
        c = RemediationClient(job=cfg["job"], redis_url=cfg["redis_url"], optimizer=opt, scheduler=sched,
                              heartbeat_interval=0.2, max_backoff=0.3, sync_every=cfg.get("sync_every", 1))
        saves: list[int] = []

        @c.handler("save_checkpoint")
        def save(params: dict) -> dict:
            saves.append(c.step or 0)
            if cfg.get("ckpt_dir"):  # a real file per rank, named by the step every rank agreed on
                path = Path(cfg["ckpt_dir"]) / f"{cfg['job']}-step-{c.step}.rank{rank}.pt"
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": c.step}, path)
                return {"saved_at": c.step, "path": str(path)}
            return {"saved_at": c.step}

        @c.handler("rollback_checkpoint")
        def rollback(params: dict) -> dict:
            if rank == world - 1:
                raise RuntimeError(f"rank {rank} has no checkpoint")
            return {"restored": True}
        return c

    if client_first:  # made before the process group exists: it must find its rank on its own
        rc = client()
    if rank != 0 and cfg.get("late_rank"):
        time.sleep(cfg["late_rank"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if rc is None:
        rc = client()

    applied: list[dict] = []
    violations: list[str] = []
    gen = torch.Generator().manual_seed(1234 + rank)
    step = start
    for step in range(start, start + cfg["max_steps"]):
        loss = ddp(torch.randn(8, 4, generator=gen)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        twin_opt.step()
        sched.step()
        twin_sched.step()
        for ack in rc.poll(step=step):
            applied.append({"record_id": ack.record_id, "action": ack.action, "status": ack.status,
                            "step": step, "result": ack.result})
            if ack.action == "scale_lr" and ack.status == "applied":
                factors = [f * g for f, g in zip(factors, ack.result["factors"])]
        lrs = [g["lr"] for g in opt.param_groups]
        twin = [g["lr"] for g in twin_opt.param_groups]
        for a, b, f in zip(lrs, twin, factors):
            if not math.isclose(a, f * b, rel_tol=1e-9, abs_tol=1e-15):
                violations.append(f"step {step}: {a} != {f} * {b}")
        records = {a["record_id"] for a in applied}
        # Every rank saw the same acks at the same step, so every rank leaves at the same step.
        if len(records) >= cfg["expect"] and step - start >= cfg.get("min_steps", 0):
            break
        time.sleep(cfg.get("step_sleep", 0.005))
    if cfg.get("save"):
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                    "twin_opt": twin_opt.state_dict(), "twin_sched": twin_sched.state_dict(),
                    "factors": factors, "step": step}, f"{cfg['save']}.{rank}")
    Path(cfg["out"]).write_text(json.dumps({
        "rank": rank, "pid": os.getpid(), "identity": rc.identity, "world": rc.world_size, "applied": applied,
        "violations": violations[:5], "n_violations": len(violations), "last_step": step, "factors": factors,
        "lrs": [g["lr"] for g in opt.param_groups], "has_inbox": rc._inbox is not None,
    }))
    faulthandler.dump_traceback_later(30, exit=True)  # a hang below prints where and ends the rank
    dist.barrier()  # as a user's script does at the end: the client must not make this hang
    rc.close()  # rank 0's ack thread flushes here
    dist.barrier()
    # Skip torch's own teardown: under load, torch 2.13's ProcessGroupGloo destructor (run when the DDP
    # reducer is freed at exit) can deadlock with its gloo thread, which waits for the GIL to free a
    # finished work item. That is torch's, not the client's; the test is about everything above.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
