"""One rank of a Hugging Face or Lightning run that spikes, for rollback_checkpoint tests (a subprocess).

Run as `python -m tests.rollback_worker CONFIG_JSON` (with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT set, as torchrun would, for a distributed run). Every step it records the loss on a fixed probe batch,
the LR and the scheduler's position; at config["spike_at"] the weights are spoiled (HF: a diverging update's
noise; Lightning: a poisoned batch); at each gate step rank 0 writes gate-STEP.json for the test and then holds
("hold": until the command the test sends is in its inbox, so it is applied at the next step) or slows down
("slow": until the test writes go-STEP). Writes what this rank saw as JSON to config["out"].

Optional: config["save_every"] 0 saves nothing; config["resume_from"] starts from that checkpoint (and records
the probe loss at the resumed step first); config["hold_in_save"] is a step whose save rank 0 pauses in the
middle of, after writing saving-STEP.json, for the test to kill it (HF: after the weights, optimizer and
scheduler, before the RNG states and trainer_state.json; Lightning: half-way through the .ckpt, written in place
by a CheckpointIO of the test's, as some custom ones do: Lightning's own writes a temporary file and renames it).
"""
from __future__ import annotations

import io
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

LR = {"hf": 1e-3, "lightning": 0.05}


def schedule(steps: int) -> Any:
    """The LR factor at a scheduler position: linear decay to 0 at `steps` (the twin that nobody touched)."""
    return lambda p: max(0.0, (steps - p) / steps)


class Recorder:
    """What every framework's callback does after the TrainMedicCallback's poll, at every step."""

    def __init__(self, cfg: dict, medic: Any):
        self.cfg, self.medic = cfg, medic
        self.dir = Path(cfg["dir"])
        self.rank = int(os.environ.get("RANK", "0"))
        self.rows: list[list[Any]] = []
        self.state: Any = None
        self.t_spike: float | None = None
        self.slowing: int | None = None
        self.factor = schedule(cfg["steps"])

    def step(self, step: int, probe: float, lr: float, position: int) -> None:
        twin = LR[self.cfg["framework"]] * self.factor(position)
        self.rows.append([step, probe, lr, position, lr / twin if twin else None])
        if self.medic.client is not None:
            self.state = self.medic.client.state_dict()
        if self.rank != 0:
            return  # the other ranks wait for rank 0 in the next step's collectives
        gate = self.cfg.get("gates", {}).get(str(step))
        if gate is not None:
            (self.dir / f"gate-{step}.json").write_text(json.dumps({"t_spike": self.t_spike, "step": step}))
        if gate == "slow":
            self.slowing = step
        if self.slowing is not None:
            # Steps go on, slowly, so that polls apply what the test waits for, until it says go.
            if (self.dir / f"go-{self.slowing}").exists():
                self.slowing = None
            else:
                time.sleep(0.1)
        if gate == "hold":
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if any(hasattr(x, "command") for x in self.medic.client._ready or ()):
                    return  # received: the next step's poll applies it, on every rank
                time.sleep(0.01)

    def paused_in_save(self, step: int) -> None:
        """Inside a save at the step the test kills this process in: say so, then wait for the kill."""
        if step == self.cfg.get("hold_in_save") and self.rank == 0:
            (self.dir / f"saving-{step}.json").write_text(json.dumps({"step": step}))
            time.sleep(600)

    def spiked(self) -> None:
        self.t_spike = time.time()

    def dump(self, global_step: int, world: int) -> None:
        Path(self.cfg["out"]).write_text(json.dumps({
            "rank": self.rank, "world": world, "global_step": global_step, "rows": self.rows, "state": self.state,
            "t_spike": self.t_spike}))


def hf(cfg: dict) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from trainmedic.client.integrations.transformers import TrainMedicCallback

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    ids = torch.randint(0, 64, (256, 8), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": x, "labels": x} for x in ids]
    probe = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(7))
    medic = TrainMedicCallback(job=cfg["job"], redis_url=cfg["redis_url"], heartbeat_interval=0.2, max_backoff=0.3)
    rec = Recorder(cfg, medic)

    def probe_loss(model: Any) -> float:
        model.eval()
        with torch.no_grad():
            loss = float(model(input_ids=probe, labels=probe).loss)
        model.train()
        return loss

    class Watch(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, lr_scheduler: Any = None,
                           optimizer: Any = None, **kw: Any) -> None:
            if cfg.get("resume_from"):  # what the resumed checkpoint holds, before any step
                rec.step(state.global_step, probe_loss(model), optimizer.param_groups[0]["lr"],
                         lr_scheduler.last_epoch)

        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, lr_scheduler: Any = None,
                        optimizer: Any = None, **kw: Any) -> None:
            if state.global_step == cfg["spike_at"]:
                noise = torch.Generator().manual_seed(99)  # the same bad update on every rank
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn(p.shape, generator=noise) * 0.5)
                rec.spiked()
            rec.step(state.global_step, probe_loss(model), optimizer.param_groups[0]["lr"], lr_scheduler.last_epoch)

    class Pausing(Trainer):
        def _save_rng_state(self, output_dir: str) -> None:
            rec.paused_in_save(self.state.global_step)
            super()._save_rng_state(output_dir)

    saves = cfg["save_every"]
    args = TrainingArguments(output_dir=cfg["dir"] + "/hf", max_steps=cfg["steps"], per_device_train_batch_size=4,
                             learning_rate=LR["hf"], lr_scheduler_type="linear", warmup_steps=0,
                             save_strategy="steps" if saves else "no", save_steps=saves or 500, report_to=[],
                             logging_strategy="no", disable_tqdm=True, use_cpu=True,
                             ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None,
                             dataloader_num_workers=0, seed=0)
    trainer = Pausing(model=model, args=args, train_dataset=data, callbacks=[medic, Watch()])
    trainer.train(resume_from_checkpoint=cfg.get("resume_from"))
    import torch.distributed as dist
    rec.dump(trainer.state.global_step, dist.get_world_size() if dist.is_initialized() else 1)


def lightning(cfg: dict) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    from trainmedic.client.integrations.lightning import TrainMedicCallback

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            if self.trainer.global_step == cfg["spike_at"] - 1:
                y = y * 100.0  # a poisoned batch: its step throws the weights far off
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=LR["lightning"], momentum=0.5)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(cfg["steps"]))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 4, generator=g)
    w = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    # Noisy targets: the loss settles near 1.0, where a few percent is a fair test.
    y = x @ w + torch.randn(4096, 1, generator=g)
    probe = torch.Generator().manual_seed(7)
    px = torch.randn(256, 4, generator=probe)
    py = px @ w + torch.randn(256, 1, generator=probe)
    medic = TrainMedicCallback(job=cfg["job"], redis_url=cfg["redis_url"], heartbeat_interval=0.2, max_backoff=0.3)
    rec = Recorder(cfg, medic)

    class Watch(pl.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            if cfg.get("resume_from"):  # what the resumed checkpoint holds, before any step
                self.on_train_batch_end(trainer, pl_module, None, None, -1)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
            if trainer.global_step == cfg["spike_at"]:
                rec.spiked()
            with torch.no_grad():
                loss = float(torch.nn.functional.mse_loss(pl_module.layer(px), py))
            rec.step(trainer.global_step, loss, trainer.optimizers[0].param_groups[0]["lr"],
                     trainer.lr_scheduler_configs[0].scheduler.last_epoch)

    class InPlaceIO(TorchCheckpointIO):
        """Writes each checkpoint straight to its path, pausing half-way at the step the test kills it in."""

        def save_checkpoint(self, checkpoint: dict, path: Any, storage_options: Any = None) -> None:
            buf = io.BytesIO()
            torch.save(checkpoint, buf)
            data = buf.getvalue()
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data[:len(data) // 2])
                f.flush()
                rec.paused_in_save(int(checkpoint["global_step"]))
                f.write(data[len(data) // 2:])

    world = int(os.environ.get("WORLD_SIZE", "1"))
    checkpoints = ModelCheckpoint(dirpath=cfg["dir"] + "/pl", filename="{step}",
                                  every_n_train_steps=cfg["save_every"] or 10**9, save_top_k=-1)
    trainer = pl.Trainer(accelerator="cpu", devices=world, num_nodes=1, strategy="ddp" if world > 1 else "auto",
                         max_steps=cfg["steps"], max_epochs=-1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=cfg["dir"],
                         callbacks=[medic, Watch(), checkpoints],
                         plugins=[InPlaceIO()] if cfg.get("hold_in_save") else None)
    trainer.fit(Tiny(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8),
                ckpt_path=cfg.get("resume_from"))
    rec.dump(trainer.global_step, trainer.world_size)


if __name__ == "__main__":
    torch.set_num_threads(1)
    config = json.loads(sys.argv[1])
    hf(config) if config["framework"] == "hf" else lightning(config)
    # torch 2.13's gloo threads can abort the interpreter's own teardown after the framework destroyed its
    # process group (see tests/framework_worker.py); the results are written, so leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
