"""Example training job for trainmedic: a small PyTorch loop that reports its signals and obeys remediations.

It learns a fixed random "teacher" network (regression) and lets trainmedic act on it through
client.RemediationClient: scale_lr / set_lr on the optimizer and its LR scheduler (built in), and
rollback_checkpoint, save_checkpoint, reduce_batch_size and stop_training through the handlers below.
Each step's loss, gradient norm and batch size go to `poll()`: the client's detectors judge the loss in
the loop (TrainingLossNaN, TrainingLossSpike), and its heartbeat carries the values to the service's
/metrics (trainmedic_training_*{job_name}), which config/rules/training.yml reads. No exporter is needed;
--metrics-port N also serves this process's own per-rank series (training_loss,
training_throughput_samples_per_second, training_gpu_info, ..., labelled job_name) on port N.

With --spike-at N it reads a corrupt data shard from step N (targets replaced by noise), so the loss
spikes on purpose; rolling back to the last good checkpoint also skips that shard, as an operator would.

It needs PyTorch and prometheus-client, which the `demo` extra brings (`pip install 'trainmedic[demo]'`; in
a checkout, `.venv/bin/pip install -e '.[demo]'`):

    export TRAINMEDIC_REDIS_URL=...   # the URL `trainmedic serve` prints (its Redis is on 127.0.0.1:6390)
    export TRAINMEDIC_VERIFY_KEY=...  # the verify key it prints too
    python examples/train.py --job demo --spike-at 600
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import time
from collections import deque
from pathlib import Path
from typing import Any
from collections.abc import Sequence

try:
    import torch
    from prometheus_client import Counter, Gauge, start_http_server
except ModuleNotFoundError as missing:  # one line, not a traceback: what to install
    raise SystemExit(f"examples/train.py needs {missing.name}, which the demo extra brings: "
                     "pip install 'trainmedic[demo]' (in a checkout: .venv/bin/pip install -e '.[demo]')") from None

from trainmedic.client import RemediationClient

log = logging.getLogger("trainer")

LOSS = Gauge("training_loss", "Mean training loss over the last --loss-window steps.", ["job_name"])
LR = Gauge("training_learning_rate", "Learning rate of the first parameter group.", ["job_name"])
THROUGHPUT = Gauge("training_throughput_samples_per_second", "Training samples per second, smoothed.",
                   ["job_name"])
STEP = Gauge("training_step", "Current optimizer step.", ["job_name"])
BATCH = Gauge("training_batch_size", "Current batch size.", ["job_name"])
GPU_INFO = Gauge("training_gpu_info", "1 for every GPU this job uses (joins dcgm-exporter's UUID).",
                 ["job_name", "gpu_id", "gpu_uuid"])
REMEDIATIONS = Counter("training_remediation_actions_total", "Remediation actions applied by this job.",
                       ["job_name", "action", "status"])


def parser() -> argparse.ArgumentParser:
    """The command-line flags (docker-compose.yml's `trainer` command uses them)."""
    p = argparse.ArgumentParser(description="Example PyTorch training job remediated by trainmedic.")
    p.add_argument("--job", default=os.environ.get("TRAINMEDIC_JOB", "example-job"),
                   help="job name: the job_name label and trainmedic's target (default: $TRAINMEDIC_JOB)")
    p.add_argument("--redis-url", default=None, help="default: $TRAINMEDIC_REDIS_URL")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="also serve this process's own Prometheus metrics on this port (default 0: none; the "
                        "service's /metrics has the job's training series without it)")
    p.add_argument("--metrics-addr", default="0.0.0.0", help="the address --metrics-port listens on")
    p.add_argument("--no-detect", action="store_true", help="turn off the client's in-loop loss detectors")
    p.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: run until stopped)")
    p.add_argument("--step-time", type=float, default=0.05,
                   help="seconds each step takes at least (stands in for a real model's compute)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--warmup", type=int, default=100, help="LR warm-up steps (LambdaLR)")
    p.add_argument("--loss-window", type=int, default=10, help="steps averaged into training_loss")
    p.add_argument("--checkpoint-dir", type=Path, default=None,
                   help="save checkpoints to DIR/JOB/checkpoint-STEP.pt (default: keep the last one in memory)")
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--spike-at", type=int, default=None, help="read a corrupt data shard from this step on")
    p.add_argument("--spike-steps", type=int, default=0,
                   help="the corrupt shard lasts this many steps (0: until a rollback skips it)")
    p.add_argument("--seed", type=int, default=0)
    return p


class Trainer:
    """The model, optimizer, LR scheduler, data and checkpoints of one job, with trainmedic's handlers."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.job = args.job
        torch.manual_seed(args.seed)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.teacher = _mlp().to(self.device).requires_grad_(False)
        self.model = _mlp().to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr)
        warmup = max(1, args.warmup)
        # Warm-up then inverse square root: a scheduler that recomputes the LR every step, which is
        # exactly what trainmedic's scheduler-safe scale_lr has to survive.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) * (warmup / max(s + 1, warmup)) ** 0.5)
        self.batch_size = args.batch_size
        self.step = 0
        self.losses: deque[float] = deque(maxlen=max(1, args.loss_window))
        self.shard_skipped = False
        self.stop_requested = False
        self.good: list[tuple[int, Any]] = []  # (step, path or in-memory state) of healthy checkpoints
        self.checkpoint_loss: float | None = None

    # -- data
    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(self.batch_size, 16, device=self.device)
        y = self.teacher(x) + 0.01 * torch.randn(self.batch_size, 1, device=self.device)
        if self.in_corrupt_shard():
            y = 30.0 * torch.randn_like(y)
        return x, y

    def in_corrupt_shard(self) -> bool:
        a = self.args
        if a.spike_at is None or self.shard_skipped or self.step < a.spike_at:
            return False
        return a.spike_steps <= 0 or self.step < a.spike_at + a.spike_steps

    # -- one step
    def train_step(self) -> tuple[float, float]:
        """One optimizer step: its loss and its gradient norm (before clipping)."""
        x, y = self.batch()
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 5.0)
        self.optimizer.step()
        self.scheduler.step()
        value = float(loss.detach())
        self.losses.append(value)
        return value, float(grad_norm)

    @property
    def smoothed_loss(self) -> float:
        return sum(self.losses) / len(self.losses) if self.losses else float("nan")

    # -- checkpoints
    def state(self) -> dict:
        return {"step": self.step, "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "batch_size": self.batch_size}

    def save(self, force: bool = False) -> dict:
        """Save a checkpoint, unless the loss has blown up since the last one (a bad state is no rollback point)."""
        loss = self.smoothed_loss
        if not force and self.checkpoint_loss is not None and loss > 2 * self.checkpoint_loss:
            return {"saved": False, "reason": f"loss {loss:.3g} is over twice the last checkpoint's"}
        self.checkpoint_loss = loss
        if self.args.checkpoint_dir is None:
            self.good = [(self.step, _clone(self.state()))]
            return {"saved": True, "step": self.step, "path": None}
        folder = self.args.checkpoint_dir / self.job
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"checkpoint-{self.step}.pt"
        tmp = path.with_suffix(".pt.tmp")
        torch.save(self.state(), tmp)
        os.replace(tmp, path)  # never a half-written checkpoint under the real name
        self.good.append((self.step, path))
        return {"saved": True, "step": self.step, "path": str(path)}

    def rollback(self, params: dict) -> dict:
        """trainmedic's rollback_checkpoint: restore the newest healthy checkpoint and skip the bad shard."""
        for step, where in reversed(self.good):
            if isinstance(where, Path) and not where.exists():
                continue  # e.g. removed by the agent's disk_cleanup
            state = torch.load(where, map_location=self.device) if isinstance(where, Path) else where
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.shard_skipped = True
            self.losses.clear()
            return {"restored_step": step, "path": str(where) if isinstance(where, Path) else None,
                    "skipped_corrupt_shard": self.args.spike_at is not None}
        raise RuntimeError("no checkpoint to roll back to yet")

    def resume(self) -> None:
        """Continue from the newest checkpoint of this job in --checkpoint-dir, if there is one."""
        if self.args.checkpoint_dir is None:
            return
        found = sorted((self.args.checkpoint_dir / self.job).glob("checkpoint-*.pt"),
                       key=lambda p: int(p.stem.split("-")[-1]) if p.stem.split("-")[-1].isdigit() else -1)
        if found:
            state = torch.load(found[-1], map_location=self.device)
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.step, self.batch_size = int(state["step"]), int(state["batch_size"])
            self.good = [(int(state["step"]), found[-1])]
            log.info("resumed %s from %s", self.job, found[-1])

    # -- trainmedic handlers
    def register(self, rc: RemediationClient) -> None:
        rc.register("rollback_checkpoint", self.rollback)
        rc.register("save_checkpoint", lambda params: self.save(force=True))
        rc.register("reduce_batch_size", self.reduce_batch_size)
        rc.register("stop_training", self.request_stop)

    def reduce_batch_size(self, params: dict) -> dict:
        old = self.batch_size
        self.batch_size = max(int(params.get("min", 1)), int(old * float(params.get("factor", 0.5))))
        return {"old_batch_size": old, "new_batch_size": self.batch_size}

    def request_stop(self, params: dict) -> dict:
        self.stop_requested = True
        return {"stopping_at_step": self.step}


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return obj


def export_gpus(job: str) -> None:
    """training_gpu_info for the GPU this process trains on, by UUID (what dcgm-exporter calls it)."""
    if not torch.cuda.is_available():
        return
    try:
        d = torch.cuda.current_device()
        uuid = str(torch.cuda.get_device_properties(d).uuid)
        GPU_INFO.labels(job, str(d), uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}").set(1)
    except Exception as exc:  # metrics are a nicety: never stop training for them
        log.warning("cannot describe the GPU for metrics: %s", exc)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    t = Trainer(args)
    t.resume()
    if args.metrics_port:
        start_http_server(args.metrics_port, addr=args.metrics_addr)
        export_gpus(args.job)
    stop = {"signal": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(signal=True))  # docker stop: finish the step, exit

    with RemediationClient(job=args.job, redis_url=args.redis_url, optimizer=t.optimizer,
                           scheduler=t.scheduler, detect=not args.no_detect) as rc:
        t.register(rc)
        log.info("training %s on %s (own metrics on :%s)", args.job, t.device, args.metrics_port or "-")
        samples_per_s = 0.0
        while not (stop["signal"] or t.stop_requested) and (not args.steps or t.step < args.steps):
            started = time.perf_counter()
            batch = t.batch_size
            loss, grad_norm = t.train_step()
            t.step += 1
            # trainmedic's commands apply here, between two steps; the step's signals go with the call.
            for ack in rc.poll(step=t.step, loss=loss, grad_norm=grad_norm, samples=batch):
                REMEDIATIONS.labels(args.job, ack.action, ack.status).inc()
                log.info("step %d: %s %s %s", t.step, ack.action, ack.status, ack.result)
            if args.checkpoint_every and t.step % args.checkpoint_every == 0:
                t.save()
            spare = args.step_time - (time.perf_counter() - started)
            if spare > 0:
                time.sleep(spare)
            rate = t.batch_size / max(time.perf_counter() - started, 1e-9)
            samples_per_s = rate if samples_per_s == 0 else 0.9 * samples_per_s + 0.1 * rate
            if args.metrics_port:  # without it the heartbeat alone carries the job's signals to the service
                export(args.job, t, samples_per_s)
            if t.step % 100 == 0:
                log.info("step %d loss %.4g lr %.3g", t.step, loss, t.optimizer.param_groups[0]["lr"])
    log.info("stopped at step %d", t.step)
    return 0


def export(job: str, t: Trainer, samples_per_s: float) -> None:
    """This process's own series, served on --metrics-port."""
    LOSS.labels(job).set(t.smoothed_loss)
    LR.labels(job).set(t.optimizer.param_groups[0]["lr"])
    THROUGHPUT.labels(job).set(samples_per_s)
    STEP.labels(job).set(t.step)
    BATCH.labels(job).set(t.batch_size)


if __name__ == "__main__":
    raise SystemExit(main())
