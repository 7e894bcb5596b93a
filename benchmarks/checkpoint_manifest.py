"""Step time after a ~1 GB checkpoint is saved, with the callback's manifest and without it, in one run.

Run: .venv/bin/python benchmarks/checkpoint_manifest.py [--gb 1.0] [--pairs 8] [--after 100]

A real Hugging Face Trainer with TrainMedicCallback (on an embedded Redis) trains a model whose checkpoint is
about --gb GB: a small MLP that trains (one CPU thread), plus a large persistent buffer saved with its weights.
It saves every --after + 20 steps, 2 x --pairs times. Saves come in pairs, one with the manifest and one
without (the callback's writer passes every other save on), in ABBA order, so that a drift in the machine's
other load falls on both alike. The figure is each kind's time per step over the --after steps that follow
each save, while the manifest is hashed (SHA-256 of every file, by a child process at nice 19) and written;
the save's own step is left out, and before the next save the manifest has been written (outside the steps
measured). Wall time is what a step costs: the goal is judged on the median step, since on a shared machine
the mean follows bursts of the other users' load; the mean and the training thread's CPU time (far less
disturbed by other users) are shown beside it.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from trainmedic.client import manifest  # noqa: E402
from trainmedic.client.integrations._manifests import ManifestWriter  # noqa: E402
from trainmedic.client.integrations.transformers import TrainMedicCallback  # noqa: E402
from trainmedic.service.embedded_redis import EmbeddedRedis  # noqa: E402

GOAL = 1.01


def with_manifest(i: int) -> bool:
    """Whether save i (from 0) gets its manifest: pairs in ABBA order (with, without, without, with, ...)."""
    return (i % 2 == 0) == (i // 2 % 2 == 0)


class EveryOther(ManifestWriter):
    """The callback's writer, passing on only the saves with_manifest() picks."""

    def __init__(self) -> None:
        super().__init__()
        self.saves = 0

    def submit(self, checkpoint: str, step: int, trainmedic: Any) -> None:
        if with_manifest(self.saves):
            super().submit(checkpoint, step, trainmedic)
        self.saves += 1


class Model(torch.nn.Module):
    """An MLP that trains, and a persistent buffer that makes its checkpoint large (saved, never trained)."""

    def __init__(self, ballast: torch.Tensor):
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                       torch.nn.ReLU(), torch.nn.Linear(1024, 1))
        self.register_buffer("ballast", ballast)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": torch.nn.functional.mse_loss(self.mlp(x).squeeze(-1), labels)}


class Clock(TrainerCallback):
    """Each step's wall and CPU time (from one on_step_end to the next), the saves, and when each manifest
    was in place; before each save it waits for the last one's manifest (a step that is not measured)."""

    def __init__(self, out: Path, writer: ManifestWriter, every: int, after: int):
        self.out, self.writer, self.every, self.after = out, writer, every, after
        self.last = (0.0, 0.0)
        self.wall: dict[int, float] = {}
        self.cpu: dict[int, float] = {}
        self.saves: list[tuple[int, float]] = []  # (step, wall-clock time of the save)
        self.written: list[float] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        now = (time.perf_counter(), time.thread_time())
        if self.last[0]:
            self.wall[state.global_step] = now[0] - self.last[0]
            self.cpu[state.global_step] = now[1] - self.last[1]
        if self.saves and state.global_step == self.saves[-1][0] + self.after + 5:
            self.writer.wait()
            step, at = self.saves[-1]
            written = Path(manifest.location(str(self.out / f"checkpoint-{step}"))[0])
            if written.exists():
                self.written.append(written.stat().st_mtime - at)
        self.last = (time.perf_counter(), time.thread_time())

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.saves.append((state.global_step, time.time()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--after", type=int, default=100)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ballast = torch.randn(int(args.gb * 2**30 / 4), generator=torch.Generator().manual_seed(0))
    tmp = Path(tempfile.mkdtemp(prefix="trainmedic-manifest-"))
    server = EmbeddedRedis(tmp / "redis", appendonly=False).start()
    out, every = tmp / "run", args.after + 20
    try:
        data = [{"x": torch.randn(1024, generator=torch.Generator().manual_seed(i)), "labels": torch.tensor(0.0)}
                for i in range(128)]
        medic = TrainMedicCallback(job="bench-manifest", redis_url=server.url, heartbeat_interval=1.0)
        writer = medic._manifests = EveryOther()
        clock = Clock(out, writer, every, args.after)
        targs = TrainingArguments(output_dir=str(out), max_steps=2 * args.pairs * every + args.after + 10,
                                  per_device_train_batch_size=128, save_strategy="steps", save_steps=every,
                                  save_total_limit=2, report_to=[], logging_strategy="no", disable_tqdm=True,
                                  use_cpu=True, dataloader_num_workers=0, seed=0)
        torch.manual_seed(0)
        Trainer(model=Model(ballast), args=targs, train_dataset=data, callbacks=[medic, clock]).train()
        writer.wait()
        size = max(sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) for d in out.glob("checkpoint-*"))
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    saves = [s for s, _ in clock.saves][:2 * args.pairs]

    def window(kind: dict[int, float], i: int) -> list[float]:
        return [kind[saves[i] + k] for k in range(2, args.after + 2) if saves[i] + k in kind]

    rows = []
    for kind in (clock.wall, clock.cpu):
        by = {v: [t for i in range(len(saves)) if with_manifest(i) == v for t in window(kind, i)] for v in (1, 0)}
        pairs = [statistics.mean(window(kind, i if with_manifest(i) else i + 1)) /
                 statistics.mean(window(kind, i + 1 if with_manifest(i) else i)) for i in range(0, len(saves), 2)]
        rows.append((statistics.mean(by[0]), statistics.mean(by[1]), statistics.median(by[0]),
                     statistics.median(by[1]), pairs, len(by[0]), len(by[1])))
    (wall0, wall1, med0, med1, pairs, n0, n1), (cpu0, cpu1, *_rest) = rows
    ratio = med1 / med0
    print(f"checkpoint {size / 2**30:.2f} GiB; {len(saves)} saves in one run, {args.pairs} with a manifest and "
          f"{args.pairs} without (ABBA), {args.after} steps measured after each ({n1} and {n0} steps)")
    print("                        without manifest   with manifest   ratio")
    print(f"median step, wall       {1000 * med0:12.2f} ms   {1000 * med1:10.2f} ms   {ratio:.4f}"
          f"   (goal <= {GOAL}: {'met' if ratio <= GOAL else 'NOT met'})")
    print(f"mean step, wall         {1000 * wall0:12.2f} ms   {1000 * wall1:10.2f} ms   {wall1 / wall0:.4f}"
          "   (follows the machine's other load)")
    print(f"mean step, thread CPU   {1000 * cpu0:12.2f} ms   {1000 * cpu1:10.2f} ms   {cpu1 / cpu0:.4f}")
    print(f"per-pair wall ratios: {', '.join(f'{x:.3f}' for x in pairs)} (median {statistics.median(pairs):.4f})")
    print(f"manifest in place after its save: median {statistics.median(clock.written):.1f} s, "
          f"max {max(clock.written):.1f} s ({len(clock.written)} manifests)")
    results = ROOT / "benchmarks" / "results"
    results.mkdir(exist_ok=True)
    (results / "checkpoint_manifest.json").write_text(json.dumps({
        "checkpoint_bytes": size, "mean_wall_ms": {"without": 1000 * wall0, "with": 1000 * wall1},
        "median_wall_ms": {"without": 1000 * med0, "with": 1000 * med1}, "ratio_median_wall": ratio,
        "ratio_mean_wall": wall1 / wall0,
        "mean_cpu_ms": {"without": 1000 * cpu0, "with": 1000 * cpu1}, "pair_ratios": pairs,
        "manifest_in_place_after_s": clock.written}, indent=1))


if __name__ == "__main__":
    main()
