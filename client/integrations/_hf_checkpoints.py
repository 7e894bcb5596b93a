"""The Hugging Face Trainer's checkpoints (output_dir/checkpoint-N/) as rollback_checkpoint reads and restores them."""
from __future__ import annotations

import json
import os
import re
from typing import Any

import torch

from ..receiver.applier import ActionFailed, ActionUnsupported
from ._rollback import Checkpoint, saved_time

# The attribute of the callback's ExportableState that holds the wall-clock time its checkpoint was saved.
SAVED_AT_ATTR = "_trainmedic_saved_at"
TRAINER_STATE = "trainer_state.json"
OPTIMIZER, SCHEDULER, SCALER = "optimizer.pt", "scheduler.pt", "scaler.pt"
SAFE_WEIGHTS, SAFE_INDEX = "model.safetensors", "model.safetensors.index.json"
WEIGHTS, WEIGHTS_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
_FOLDER = re.compile(r"^checkpoint-(\d+)$")


def check_supported(args: Any) -> None:
    """ActionUnsupported for runs whose checkpoints are sharded across ranks (DeepSpeed, FSDP)."""
    if getattr(args, "deepspeed", None) or getattr(args, "fsdp", None):
        raise ActionUnsupported("The built-in rollback_checkpoint restores single-process and DDP runs, not "
                                "DeepSpeed or FSDP ones; register a handler for it")


def _callback_state(trainer_state: dict[str, Any], name: str) -> dict[str, Any]:
    saved = (trainer_state.get("stateful_callbacks") or {}).get(name)
    saved = saved[-1] if isinstance(saved, list) and saved else saved
    return (saved.get("attributes") or {}) if isinstance(saved, dict) else {}


def _complete(folder: str) -> bool:
    # The optimizer's moments belong with the weights: restoring one without the other mixes two points of the run.
    weights = (SAFE_WEIGHTS, SAFE_INDEX, WEIGHTS, WEIGHTS_INDEX)
    has_weights = any(os.path.isfile(os.path.join(folder, f)) for f in weights)
    return has_weights and all(os.path.isfile(os.path.join(folder, f)) for f in (TRAINER_STATE, OPTIMIZER, SCHEDULER))


def checkpoints(output_dir: str, callback: str, now: int | None) -> list[Checkpoint]:
    """The complete checkpoint-N folders of output_dir, at steps up to `now` (a later step is another run's)."""
    try:
        names = os.listdir(output_dir)
    except OSError:
        return []
    found = []
    for name in sorted(names):
        folder = os.path.join(output_dir, name)
        if not _FOLDER.match(name) or not _complete(folder):
            continue
        state_file = os.path.join(folder, TRAINER_STATE)
        try:
            with open(state_file) as f:
                state = json.load(f)
            step = int(state["global_step"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # half-written or foreign: not a checkpoint to restore
        if now is not None and step > now:
            continue
        # trainer_state.json is written last, so its mtime is the fallback for a checkpoint without our stamp.
        saved_at, stamped = saved_time(_callback_state(state, callback).get(SAVED_AT_ATTR), state_file)
        found.append(Checkpoint(folder, step, saved_at, stamped))
    return found


def _weights(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    for index, load in ((SAFE_INDEX, lambda p: load_file(p, device="cpu")),
                        (WEIGHTS_INDEX, lambda p: torch.load(p, map_location="cpu", weights_only=True))):
        path = os.path.join(folder, index)
        if os.path.isfile(path):
            with open(path) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            out: dict[str, torch.Tensor] = {}
            for shard in shards:
                out.update(load(os.path.join(folder, os.path.basename(shard))))
            return out
    if os.path.isfile(os.path.join(folder, SAFE_WEIGHTS)):
        return load_file(os.path.join(folder, SAFE_WEIGHTS), device="cpu")
    return dict(torch.load(os.path.join(folder, WEIGHTS), map_location="cpu", weights_only=True))


def _check_keys(model: Any, weights: dict[str, torch.Tensor]) -> None:
    """ActionFailed, before anything changes, when the weights are not this model's."""
    own = model.state_dict(keep_vars=True)
    unexpected = sorted(set(weights) - set(own))
    loaded = {own[k].data_ptr() for k in weights if k in own}
    # A tied weight (GPT-2's lm_head and wte) is saved once: missing is fine when it shares a loaded one's storage.
    missing = sorted(k for k in set(own) - set(weights) if own[k].data_ptr() not in loaded)
    if unexpected or missing:
        raise ActionFailed(f"The checkpoint's weights do not fit this model ({len(missing)} missing, "
                           f"{len(unexpected)} unexpected, e.g. {(missing + unexpected)[0]}); nothing was restored.")


def restore(folder: str, model: Any, optimizer: Any, scheduler: Any, callback: str) -> Any:
    """Load a checkpoint's weights, optimizer, scheduler and scaler into the running objects; returns the
    client state saved with it. Every file is read before anything changes, so a bad file changes nothing."""
    if model is None or optimizer is None:
        raise ActionUnsupported("The Trainer gave the callback no model or optimizer to restore")
    weights = _weights(folder)
    _check_keys(model, weights)
    opt_state = torch.load(os.path.join(folder, OPTIMIZER), map_location="cpu", weights_only=True)
    sched_state = torch.load(os.path.join(folder, SCHEDULER), weights_only=True)
    # accelerate keeps the AMP GradScaler on its optimizer wrapper (the Trainer saves it as scaler.pt).
    scaler: Any = getattr(optimizer, "scaler", None)
    scaler_file = os.path.join(folder, SCALER)
    scaler_state = torch.load(scaler_file, weights_only=True) if scaler is not None and os.path.isfile(scaler_file) \
        else None
    with open(os.path.join(folder, TRAINER_STATE)) as f:
        client_state = _callback_state(json.load(f), callback).get("_trainmedic_saved")
    with torch.no_grad():
        model.load_state_dict(weights, strict=False)  # the keys were checked above; tied ones follow their twin
    optimizer.load_state_dict(opt_state)  # torch moves the state onto each parameter's device
    if scheduler is not None:
        scheduler.load_state_dict(sched_state)
    if scaler_state is not None:
        scaler.load_state_dict(scaler_state)
    return client_state
