"""Lightning's .ckpt files as rollback_checkpoint reads and restores them."""
from __future__ import annotations

import glob
import os
from typing import Any

import torch

from ._rollback import SAVED_AT, Checkpoint, saved_time


def _peek(path: str) -> dict[str, Any] | None:
    """A checkpoint's small entries, its tensors left on disk (mmap), or None for a file that is not one."""
    try:
        ckpt = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception:  # half-written, or another format: not a checkpoint to restore
        return None
    return ckpt if isinstance(ckpt, dict) else None


def _callback_state(ckpt: dict[str, Any], key: str) -> dict[str, Any]:
    state = (ckpt.get("callbacks") or {}).get(key)
    return state if isinstance(state, dict) else {}


def checkpoints(folders: list[str], key: str, now: int | None) -> list[Checkpoint]:
    """The .ckpt files in these folders (each once, links resolved), at steps up to `now` (later: another run's)."""
    paths = dict.fromkeys(os.path.realpath(p) for folder in folders for p in sorted(glob.glob(
        os.path.join(glob.escape(folder), "*.ckpt"))) if os.path.isfile(p))
    found = []
    for path in paths:
        ckpt = _peek(path)
        if ckpt is None or "state_dict" not in ckpt or "optimizer_states" not in ckpt:
            continue  # weights only (save_weights_only): restoring them without the optimizer mixes two points
        step = int(ckpt.get("global_step", 0))
        if now is not None and step > now:
            continue
        saved_at, stamped = saved_time(_callback_state(ckpt, key).get(SAVED_AT), path)
        found.append(Checkpoint(path, step, saved_at, stamped))
    return found


def restore(trainer: Any, path: str, key: str) -> Any:
    """Load a checkpoint's weights, optimizers, LR schedulers and precision (scaler) state through the trainer's
    strategy and checkpoint_io; returns the client state saved with it. The loops, and so the data, go on."""
    strategy = trainer.strategy
    ckpt = strategy.load_checkpoint(path)
    schedulers = ckpt.get("lr_schedulers") or []
    strategy.load_model_state_dict(ckpt, strict=True)
    strategy.load_optimizer_state_dict(ckpt)
    for config, state in zip(trainer.lr_scheduler_configs, schedulers):
        config.scheduler.load_state_dict(state)
    precision = trainer.precision_plugin
    name = type(precision).__qualname__
    if name in ckpt:  # MixedPrecision keeps its GradScaler's state here
        precision.load_state_dict(ckpt[name])
    return _callback_state(ckpt, key).get("trainmedic")
