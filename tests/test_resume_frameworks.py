"""Sticky changes across a framework's own resume: Trainer(resume_from_checkpoint=...) and fit(ckpt_path=...)."""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable

import pytest
import redis
import torch

from trainmedic.service.store import record as records

from tests.support.jobs import job_app, trigger

STEPS = 80
CHANGE_AT = 30  # halve-lr is sent at this step; checkpoints every 20 steps: 20 is before it, 60 after


class Twin:
    """The untouched schedule, stepped in lockstep with the run; records the run's LR over the twin's."""

    def __init__(self, make: Callable[[torch.optim.Optimizer], Any], lr: float, start: int = 0):
        self.opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
        self.sched = make(self.opt)
        for _ in range(start):
            self.opt.step()
            self.sched.step()
        self.ratios: list[tuple[int, float]] = []

    def step(self, global_step: int, lr: float) -> None:
        self.opt.step()
        self.sched.step()
        twin = self.opt.param_groups[0]["lr"]
        if twin:
            self.ratios.append((global_step, lr / twin))


class Conductor:
    """Sends halve-lr at CHANGE_AT and waits for it to be applied before training goes on."""

    def __init__(self, r: redis.Redis, http: Any, job: str):
        self.r, self.http, self.job = r, http, job
        self.rid: str | None = None

    def step(self, global_step: int) -> None:
        if global_step == CHANGE_AT and self.rid is None:
            self.rid = trigger(self.http, "halve-lr", self.job)["id"]
        if self.rid is not None:
            deadline = time.monotonic() + 10
            while records.get(self.r, self.rid)["status"] == "dispatched" and time.monotonic() < deadline:
                time.sleep(0.01)  # the client applies at the next step's poll; the receiver needs a moment


def ratios_after(twin: Twin, step: int) -> list[float]:
    return [q for s, q in twin.ratios if s >= step]


def reapplied(r: redis.Redis, rid: str) -> list[dict]:
    rec = records.get(r, rid)
    assert rec is not None
    return list(rec["actions"][0]["reapplied"])


# ---------------------------------------------------------------- Hugging Face

def hf_run(tmp: Path, job: str, redis_url: str, on_step: Callable[[int, float], None],
           resume: Path | None = None) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from trainmedic.client.integrations.transformers import TrainMedicCallback

    class Watch(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kw: Any) -> None:
            on_step(state.global_step, optimizer.param_groups[0]["lr"])
            time.sleep(0.005)

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    ids = torch.randint(0, 64, (64, 8), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": x, "labels": x} for x in ids]
    args = TrainingArguments(output_dir=str(tmp / "hf"), max_steps=STEPS, per_device_train_batch_size=4,
                             learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=0, save_strategy="steps",
                             save_steps=20, report_to=[], logging_strategy="no", disable_tqdm=True, use_cpu=True,
                             dataloader_num_workers=0, seed=0)
    medic = TrainMedicCallback(job=job, redis_url=redis_url, heartbeat_interval=0.2, max_backoff=0.3)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[medic, Watch()])
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    return trainer


def linear(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, (STEPS - s) / STEPS))


def test_a_transformers_trainer_resumed_from_before_a_change_applies_it_again_once(
        r: redis.Redis, make_app: Any, tmp_path: Path, redis_url: str) -> None:
    http = job_app(make_app, tmp_path).test_client()
    conductor = Conductor(r, http, "hf-resume")
    first = Twin(linear, 1e-3)
    hf_run(tmp_path, "hf-resume", redis_url, lambda s, lr: (first.step(s, lr), conductor.step(s)))
    assert conductor.rid is not None
    applied_at = records.get(r, conductor.rid)["actions"][0]["result"]["step"]
    assert all(math.isclose(q, 0.5, rel_tol=1e-6) for q in ratios_after(first, applied_at))

    before = Twin(linear, 1e-3, start=20)  # the twin of a run resumed at step 20, before the change
    hf_run(tmp_path, "hf-resume", redis_url, before.step, resume=tmp_path / "hf" / "checkpoint-20")
    [again] = reapplied(r, conductor.rid)
    # Applied again at the first poll after the ledger was read (within a few steps), then never again.
    assert again["step"] <= 20 + 10
    tail = ratios_after(before, again["step"] + 1)
    assert tail and all(math.isclose(q, 0.5, rel_tol=1e-6) for q in tail), tail[:5]

    after = Twin(linear, 1e-3, start=60)  # resumed at step 60, after the change: its checkpoint holds it
    hf_run(tmp_path, "hf-resume", redis_url, after.step, resume=tmp_path / "hf" / "checkpoint-60")
    assert after.ratios and all(math.isclose(q, 0.5, rel_tol=1e-6) for _, q in after.ratios)
    assert len(reapplied(r, conductor.rid)) == 1  # nothing applied again


# ---------------------------------------------------------------- Lightning

def pl_run(tmp: Path, job: str, redis_url: str, on_step: Callable[[int, float], None],
           ckpt_path: Path | None = None) -> Any:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from trainmedic.client.integrations.lightning import TrainMedicCallback

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=0.05)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": steplr(opt), "interval": "step"}}

    class Watch(pl.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
            on_step(trainer.global_step, trainer.optimizers[0].param_groups[0]["lr"])
            time.sleep(0.005)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(512, 4, generator=g), torch.randn(512, 1, generator=g))
    checkpoints = ModelCheckpoint(dirpath=tmp / "pl", filename="step-{step}", every_n_train_steps=20, save_top_k=-1)
    medic = TrainMedicCallback(job=job, redis_url=redis_url, heartbeat_interval=0.2, max_backoff=0.3)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, max_epochs=-1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[medic, checkpoints, Watch()])
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4), ckpt_path=ckpt_path)
    return trainer


def steplr(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=25, gamma=0.8)


def test_a_lightning_trainer_resumed_from_before_a_change_applies_it_again_once(
        r: redis.Redis, make_app: Any, tmp_path: Path, redis_url: str) -> None:
    http = job_app(make_app, tmp_path).test_client()
    conductor = Conductor(r, http, "pl-resume")
    first = Twin(steplr, 0.05)
    pl_run(tmp_path, "pl-resume", redis_url, lambda s, lr: (first.step(s, lr), conductor.step(s)))
    assert conductor.rid is not None
    applied_at = records.get(r, conductor.rid)["actions"][0]["result"]["step"]
    assert all(math.isclose(q, 0.5, rel_tol=1e-6) for q in ratios_after(first, applied_at))
    saved = sorted((tmp_path / "pl").glob("*.ckpt"))
    by_step = {int(p.stem.split("=")[1]): p for p in saved}
    assert {20, 60} <= set(by_step), saved

    before = Twin(steplr, 0.05, start=20)
    pl_run(tmp_path, "pl-resume", redis_url, before.step, ckpt_path=by_step[20])
    [again] = reapplied(r, conductor.rid)
    assert again["step"] <= 20 + 10
    tail = ratios_after(before, again["step"] + 1)
    assert tail and all(math.isclose(q, 0.5, rel_tol=1e-6) for q in tail), tail[:5]

    after = Twin(steplr, 0.05, start=60)
    pl_run(tmp_path, "pl-resume", redis_url, after.step, ckpt_path=by_step[60])
    assert after.ratios and all(math.isclose(q, 0.5, rel_tol=1e-6) for _, q in after.ratios)
    assert len(reapplied(r, conductor.rid)) == 1


@pytest.mark.parametrize("framework", ["transformers", "lightning"])
def test_the_callbacks_keep_the_client_state_in_the_frameworks_own_checkpoints(framework: str) -> None:
    if framework == "transformers":
        from trainmedic.client.integrations.transformers import TrainMedicCallback

        cb = TrainMedicCallback(job="x")
        cb.restore({"version": 1, "commands": [["r", "", []]]})
        assert cb.state()["attributes"]["_trainmedic_saved"]["commands"] == [["r", "", []]]
    else:
        from trainmedic.client.integrations.lightning import TrainMedicCallback as PlCallback

        pl_cb = PlCallback(job="x")
        pl_cb.load_state_dict({"trainmedic": {"version": 1, "commands": [["r", "", []]]}})
        saved = pl_cb.state_dict()
        assert saved["trainmedic"] == {"version": 1, "commands": [["r", "", []]]}
        assert abs(saved["saved_at"] - time.time()) < 5
