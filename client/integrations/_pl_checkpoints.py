"""Lightning's .ckpt files as rollback_checkpoint reads and restores them."""
from __future__ import annotations

import glob
import os
from typing import Any

import torch

from .. import manifest
from ..checkpoints import Checkpoint
from ..receiver.applier import ActionFailed
from ._rollback import SAVED_AT, saved_time


def _peek(path: str) -> dict[str, Any] | None:
    """A checkpoint's small entries, its tensors left on disk (mmap), or None for a file that does not open."""
    try:
        ckpt = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception:  # half-written, damaged, or another format
        return None
    return ckpt if isinstance(ckpt, dict) else None


def _callback_state(ckpt: dict[str, Any], key: str) -> dict[str, Any]:
    state = (ckpt.get("callbacks") or {}).get(key)
    return state if isinstance(state, dict) else {}


def _files(folders: list[str]) -> list[str]:
    """The .ckpt files in these folders, each once (a link to one counts as it; a link out of the folders is
    not followed), named as the folder holds them."""
    by_real: dict[str, str] = {}
    for folder in folders:
        for path in sorted(glob.glob(os.path.join(glob.escape(folder), "*.ckpt"))):
            if not os.path.isfile(path) or (os.path.islink(path) and not any(
                    manifest.inside(path, f) for f in folders)):
                continue
            real = os.path.realpath(path)
            if real not in by_real or os.path.islink(by_real[real]):
                by_real[real] = path
    return list(by_real.values())


def checkpoints(folders: list[str], key: str, now: int | None) -> list[Checkpoint]:
    """The .ckpt files in these folders, whole or not, at steps up to `now` (a later step is another run's).

    A file that opens tells its step and stamp (one saved without optimizer state, save_weights_only, is left
    out: restoring its weights alone would mix two points of the run); one that does not open is still a
    checkpoint the run saved, at its manifest's step and stamp, else at an unknown step and its mtime.
    """
    found = []
    for path in _files(folders):
        try:
            ckpt = _peek(path)
            if ckpt is not None:
                if "state_dict" not in ckpt or "optimizer_states" not in ckpt:
                    continue
                step: int | None = int(ckpt.get("global_step", 0))
                saved_at, stamped = saved_time(_callback_state(ckpt, key).get(SAVED_AT), path)
            else:
                try:
                    m = manifest.read(path)
                except manifest.ManifestError:
                    m = None
                step = m.step if m is not None else None
                stamp = m.saved_at if m is not None else None
                saved_at, stamped = saved_time(stamp, path)
        except OSError:
            continue  # removed while listing (save_top_k): not a checkpoint any more
        if now is not None and step is not None and step > now:
            continue
        found.append(Checkpoint(path, step, saved_at, stamped))
    return found


def restore(trainer: Any, path: str, key: str) -> Any:
    """Load a checkpoint's weights, optimizers, LR schedulers and precision (scaler) state through the trainer's
    strategy and checkpoint_io; returns the client state saved with it. The loops, and so the data, go on."""
    strategy = trainer.strategy
    try:
        ckpt = strategy.load_checkpoint(path)
    except Exception as exc:
        raise ActionFailed(f"The checkpoint {path} could not be read ({type(exc).__name__}: {exc}); nothing "
                           "was restored.") from None
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
