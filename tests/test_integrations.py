"""Hugging Face Trainer and Lightning Trainer runs (tiny models built from config) remediated through the service."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from trainmedic.service.store import record as records
from trainmedic.client.wire import keys
from trainmedic.service.embedded_redis import free_port
from tests.conftest import ROOT
from tests.support.jobs import job_app, settled, trigger, wait_record, wait_until

STEPS = 2000  # a ceiling; the runs end when stop_training arrives


class Conductor:
    """Sends halve-lr, then save, then stop through the service as training goes, and checks the LR twin."""

    def __init__(self, r: redis.Redis, http: Any, job: str, twin_sched: Any, twin_opt: Any):
        self.r, self.http, self.job = r, http, job
        self.twin_opt, self.twin_sched = twin_opt, twin_sched
        self.plan = ["halve-lr", "save", "stop"]
        self.records: dict[str, str] = {}
        self.current: str | None = None
        self.ratios: list[tuple[int, list[float]]] = []

    def step(self, step: int, lrs: list[float]) -> None:
        """Called once per optimizer step, after the trainer's scheduler step and the client's poll."""
        self.twin_opt.step()
        self.twin_sched.step()
        twin = self.twin_opt.param_groups[0]["lr"]
        if twin:
            self.ratios.append((step, [a / twin for a in lrs]))
        if step < 5:
            return
        if self.current is not None and not settled(records.get(self.r, self.records[self.current])):
            time.sleep(0.003)  # give the receiver thread a moment; a real step takes longer
            return
        if self.plan:
            self.current = self.plan.pop(0)
            self.records[self.current] = trigger(self.http, self.current, self.job)["id"]
        else:
            self.current = None

    def record(self, name: str) -> dict:
        rec = records.get(self.r, self.records[name])
        assert rec is not None
        return rec

    def check_ratio(self) -> None:
        """1.0 to the twin before the step scale_lr was applied at, exactly 0.5 from that step on."""
        halved_at = self.record("halve-lr")["actions"][0]["result"]["step"]
        after = [q for s, qs in self.ratios if s >= halved_at for q in qs]
        before = [q for s, qs in self.ratios if s < halved_at for q in qs]
        assert len(after) >= 3 and len(before) >= 3
        assert all(math.isclose(q, 1.0, rel_tol=1e-9) for q in before), before[:10]
        assert all(math.isclose(q, 0.5, rel_tol=1e-9) for q in after), after[:10]


# ---------------------------------------------------------------- Hugging Face

def tiny_gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    return GPT2LMHeadModel(config)  # randomly initialised from the config: nothing is downloaded


class TokenData(torch.utils.data.Dataset):
    """Synthetic token sequences."""

    def __init__(self, n: int = 64, length: int = 8):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 64, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def test_a_hugging_face_trainer_takes_scale_lr_save_and_stop_from_the_service(
        r: redis.Redis, make_app: Any, tmp_path: Path, redis_url: str) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments, get_cosine_schedule_with_warmup

    from trainmedic.client.integrations.transformers import TrainMedicCallback

    http = job_app(make_app, tmp_path).test_client()
    twin_opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    twin = get_cosine_schedule_with_warmup(twin_opt, 10, STEPS)
    conductor = Conductor(r, http, "hf-job", twin, twin_opt)

    class Conduct(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kw: Any) -> None:
            conductor.step(state.global_step, [g["lr"] for g in optimizer.param_groups])

    medic = TrainMedicCallback(job="hf-job", redis_url=redis_url, heartbeat_interval=0.2, max_backoff=0.3)
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=STEPS, per_device_train_batch_size=4,
                             learning_rate=1e-3, lr_scheduler_type="cosine", warmup_steps=10,
                             save_strategy="no", report_to=[], logging_strategy="no", disable_tqdm=True,
                             use_cpu=True, dataloader_num_workers=0, seed=0)
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenData(), callbacks=[medic, Conduct()])
    trainer.train()

    conductor.check_ratio()
    halve = conductor.record("halve-lr")["actions"][0]
    assert halve["status"] == "applied"
    assert halve["result"]["new_lr"][0] == pytest.approx(halve["result"]["old_lr"][0] * 0.5, rel=1e-12)
    save = conductor.record("save")["actions"][0]
    stop = conductor.record("stop")["actions"][0]
    assert save["status"] == "applied" and stop["status"] == "applied"
    # control.should_save made the Trainer write a checkpoint at that step; should_training_stop ended it there.
    assert (tmp_path / "hf" / f"checkpoint-{save['result']['step']}").is_dir()
    assert trainer.state.global_step == stop["result"]["step"] < STEPS
    assert medic.client is None  # closed at the end of training


# ---------------------------------------------------------------- Lightning

def test_a_lightning_trainer_takes_scale_lr_save_and_stop_from_the_service(
        r: redis.Redis, make_app: Any, tmp_path: Path, redis_url: str) -> None:
    import lightning.pytorch as pl

    from trainmedic.client.integrations.lightning import TrainMedicCallback

    http = job_app(make_app, tmp_path).test_client()
    twin_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.05)
    twin = torch.optim.lr_scheduler.OneCycleLR(twin_opt, max_lr=0.05, total_steps=STEPS + 1)
    conductor = Conductor(r, http, "pl-job", twin, twin_opt)

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=0.05)
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS + 1)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Conduct(pl.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
            conductor.step(trainer.global_step, [g["lr"] for g in trainer.optimizers[0].param_groups])

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(256, 4, generator=g), torch.randn(256, 1, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    medic = TrainMedicCallback(job="pl-job", redis_url=redis_url, heartbeat_interval=0.2, max_backoff=0.3)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, max_epochs=-1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         default_root_dir=str(tmp_path / "pl"), callbacks=[medic, Conduct()])
    trainer.fit(Tiny(), loader)

    conductor.check_ratio()
    save = conductor.record("save")["actions"][0]
    stop = conductor.record("stop")["actions"][0]
    assert save["status"] == "applied" and stop["status"] == "applied"
    path = Path(save["result"]["path"])
    assert path.parent == tmp_path / "pl" / "checkpoints" and path.is_file()
    assert torch.load(path, weights_only=False)["global_step"] == save["result"]["step"]
    assert trainer.global_step == stop["result"]["step"] < STEPS
    assert medic.client is None


# ---------------------------------------------------------------- training signals from both

def signals_of(r: redis.Redis, job: str) -> list[str]:
    """The job's signals line as its heartbeat wrote it (step, since, loss, LR, samples/s, grad norm)."""
    raw = r.get(keys.signals(keys.Target("job", job)))
    return raw.decode().split(" ") if isinstance(raw, bytes) else str(raw or "").split(" ")


def test_the_hugging_face_callback_passes_the_logged_loss_grad_norm_and_samples_by_itself(
        r: redis.Redis, tmp_path: Path, redis_url: str) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from trainmedic.client.integrations.transformers import TrainMedicCallback

    medic = TrainMedicCallback(job="hf-signals", redis_url=redis_url, heartbeat_interval=0.1, max_backoff=0.3)
    seen: list[tuple[int, Any, Any, float]] = []
    logged: dict[int, dict] = {}

    class Probe(TrainerCallback):  # after the medic's callback: what the client holds once each step polled
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            assert medic.client is not None
            seen.append((state.global_step, medic.client.loss, medic.client.grad_norm, medic.client.samples))
            time.sleep(0.02)  # a few heartbeats during the run

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            logged[state.global_step] = dict(logs or {})

    args = TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=12, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, learning_rate=1e-3, save_strategy="no", report_to=[],
                             logging_steps=1, disable_tqdm=True, use_cpu=True, dataloader_num_workers=0, seed=0)
    Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenData(), callbacks=[medic, Probe()]).train()

    assert [s for s, *_ in seen] == list(range(1, 13))
    for step, loss, grad, samples in seen[1:]:
        # Step N's poll passes what the Trainer logged after step N-1 (it logs after on_step_end).
        assert loss == logged[step - 1]["loss"] and grad == logged[step - 1]["grad_norm"]
        assert samples == 8 * step  # batch 4 times 2 accumulation steps, each step
    deadline = time.monotonic() + 10
    while signals_of(r, "hf-signals")[2:3] in ([], ["-"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    line = signals_of(r, "hf-signals")
    assert line[2] != "-" and line[5] != "-" and float(line[5]) > 0, line  # loss and grad norm reached Redis


def test_the_lightning_callback_passes_each_batchs_loss_size_and_the_logged_grad_norm_by_itself(
        r: redis.Redis, tmp_path: Path, redis_url: str) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.utilities import grad_norm

    from trainmedic.client.integrations.lightning import TrainMedicCallback

    losses: list[float] = []
    norms: list[float] = []

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            losses.append(loss.item())
            return loss

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            total = grad_norm(self.layer, norm_type=2)["grad_2.0_norm_total"]
            norms.append(float(total))
            self.log("grad_2.0_norm_total", total)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    medic = TrainMedicCallback(job="pl-signals", redis_url=redis_url, heartbeat_interval=0.1, max_backoff=0.3)
    seen: list[tuple[Any, Any, float]] = []

    class Probe(pl.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
            assert medic.client is not None
            seen.append((medic.client.loss, medic.client.grad_norm, medic.client.samples))
            time.sleep(0.02)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(120, 4, generator=g), torch.randn(120, 1, generator=g))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=30, max_epochs=-1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         default_root_dir=str(tmp_path / "pl"), callbacks=[medic, Probe()])
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=6))

    assert len(seen) == 30
    assert [n for *_, n in seen] == [6.0 * (i + 1) for i in range(30)]  # every batch's size, counted
    # The loss tensor is read once in ten batches (no device synchronisation on the others): batches 10, 20, 30.
    assert [loss for loss, *_ in seen][9::10] == pytest.approx([losses[9], losses[19], losses[29]])
    assert all(loss is None for loss, *_ in seen[:9])
    assert [grad for _, grad, _ in seen][9::10] == pytest.approx([norms[9], norms[19], norms[29]], rel=1e-5)
    deadline = time.monotonic() + 10
    while signals_of(r, "pl-signals")[5:6] in ([], ["-"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    line = signals_of(r, "pl-signals")
    assert line[2] != "-" and line[4] != "-" and line[5] != "-", line  # loss, samples/s and grad norm in Redis


def test_importing_client_imports_no_framework() -> None:
    code = ("import sys, client, client.integrations; "
            "bad = [m for m in ('flask', 'gunicorn', 'transformers', 'lightning', 'pytorch_lightning', 'torch') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


# ---------------------------------------------------------------- distributed runs of both

@pytest.mark.parametrize("framework", ["hf", "lightning"])
def test_both_ranks_of_a_distributed_run_apply_each_command_at_the_same_step(
        framework: str, r: redis.Redis, make_app: Any, tmp_path: Path, redis_url: str) -> None:
    http = job_app(make_app, tmp_path).test_client()
    job = f"{framework}-ddp"
    port, procs = free_port(), []
    for rank in range(2):
        cfg = {"framework": framework, "job": job, "redis_url": redis_url, "dir": str(tmp_path / "out"),
               "out": str(tmp_path / f"rank{rank}.json")}
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        with open(tmp_path / f"rank{rank}.log", "wb") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "tests.framework_worker", json.dumps(cfg)],
                                          cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        def step() -> int:
            raw = r.get(keys.heartbeat(keys.Target("job", job)))
            return (json.loads(raw).get("step") or 0) if raw else 0

        def alive() -> None:
            for i, p in enumerate(procs):
                assert p.poll() is None, (tmp_path / f"rank{i}.log").read_text()[-3000:]
            time.sleep(0.05)

        wait_until(lambda: step() >= 15, timeout=120, tick=alive, what="both ranks training")
        halve = trigger(http, "halve-lr", job)
        halved = wait_record(r, halve["id"], timeout=60, tick=alive)
        stop = trigger(http, "stop", job)
        for p in procs:
            p.wait(120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, p in enumerate(procs):
        assert p.returncode == 0, (tmp_path / f"rank{i}.log").read_text()[-3000:]
    stopped = wait_record(r, stop["id"])
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]

    act = halved["actions"][0]
    assert act["status"] == "applied" and act["result"]["ranks"] == 2 and act["result"]["ranks_applied"] == 2
    at = act["result"]["step"]
    assert stopped["actions"][0]["result"]["ranks_applied"] == 2
    for res in results:
        assert res["world"] == 2
        before = [q for s, q in res["ratios"] if s < at]
        after = [q for s, q in res["ratios"] if s >= at]
        assert before and after
        assert all(math.isclose(q, 1.0, rel_tol=1e-9) for q in before), before[-5:]
        assert all(math.isclose(q, 0.5, rel_tol=1e-9) for q in after), after[:5]
        # Training stopped where stop_training was applied, on both ranks.
        assert res["global_step"] == stopped["actions"][0]["result"]["step"]
