"""One rank of a distributed Hugging Face or Lightning run with TrainMedicCallback (a subprocess).

Run as `python -m tests.framework_worker CONFIG_JSON` with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT set, as torchrun would; writes what this rank saw as JSON to config["out"].
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

MAX_STEPS = 3000


def hf(cfg: dict) -> dict:
    from transformers import (GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments,
                              get_cosine_schedule_with_warmup)

    from trainmedic.client.integrations.transformers import TrainMedicCallback

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    ids = torch.randint(0, 64, (64, 8), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": x, "labels": x} for x in ids]
    twin_opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    twin = get_cosine_schedule_with_warmup(twin_opt, 10, MAX_STEPS)
    seen: list[list[Any]] = []

    class Record(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kw: Any) -> None:
            twin_opt.step()
            twin.step()
            seen.append([state.global_step, optimizer.param_groups[0]["lr"] / twin_opt.param_groups[0]["lr"]])
            time.sleep(0.01)

    medic = TrainMedicCallback(job=cfg["job"], redis_url=cfg["redis_url"], heartbeat_interval=0.2)
    args = TrainingArguments(output_dir=cfg["dir"], max_steps=MAX_STEPS, per_device_train_batch_size=2,
                             learning_rate=1e-3, lr_scheduler_type="cosine", warmup_steps=10, save_strategy="no",
                             report_to=[], logging_strategy="no", disable_tqdm=True, use_cpu=True,
                             ddp_backend="gloo", dataloader_num_workers=0, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[medic, Record()])
    trainer.train()
    import torch.distributed as dist
    return {"ratios": seen, "global_step": trainer.state.global_step,
            "world": dist.get_world_size() if dist.is_initialized() else 1}


def lightning(cfg: dict) -> dict:
    import lightning.pytorch as pl

    from trainmedic.client.integrations.lightning import TrainMedicCallback

    seen: list[list[Any]] = []
    twin_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.05)
    twin = torch.optim.lr_scheduler.StepLR(twin_opt, step_size=25, gamma=0.8)

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=0.05)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=25, gamma=0.8)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
            twin_opt.step()
            twin.step()
            lr = trainer.optimizers[0].param_groups[0]["lr"]
            seen.append([trainer.global_step, lr / twin_opt.param_groups[0]["lr"]])
            time.sleep(0.01)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(512, 4, generator=g), torch.randn(512, 1, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    medic = TrainMedicCallback(job=cfg["job"], redis_url=cfg["redis_url"], heartbeat_interval=0.2)
    trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), num_nodes=1, strategy="ddp",
                         max_steps=MAX_STEPS, max_epochs=-1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=cfg["dir"],
                         callbacks=[medic, Record()])
    trainer.fit(Tiny(), loader)
    return {"ratios": seen, "global_step": trainer.global_step, "world": trainer.world_size}


def main(cfg: dict) -> None:
    torch.set_num_threads(1)
    found = hf(cfg) if cfg["framework"] == "hf" else lightning(cfg)
    found["rank"] = int(os.environ["RANK"])
    Path(cfg["out"]).write_text(json.dumps(found))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
    # torch 2.13's gloo threads can abort the interpreter's own teardown ("terminate called without an
    # active exception") after the framework has destroyed its process group; the results are written, so
    # leave without it, as tests/rank_worker.py does.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
