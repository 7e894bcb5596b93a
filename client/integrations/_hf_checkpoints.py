"""The Hugging Face Trainer's checkpoints (output_dir/checkpoint-N/) as rollback_checkpoint reads and restores them."""
from __future__ import annotations

import json
import os
import re
from typing import Any

import torch

from .. import manifest
from ..checkpoints import OPTIMIZER, SCALER, SCHEDULER, TRAINER_STATE, Checkpoint, hf_weights, newest_mtime
from ..receiver.applier import ActionFailed, ActionUnsupported
from ._rollback import saved_time

# The attribute of the callback's ExportableState that holds the wall-clock time its checkpoint was saved.
SAVED_AT_ATTR = "_trainmedic_saved_at"
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


def folder(output_dir: str, step: int) -> str:
    """Where the Trainer saves its checkpoint of `step`."""
    return os.path.join(output_dir, f"checkpoint-{step}")


def _describe(folder: str, callback: str, named_step: int) -> Checkpoint:
    """A checkpoint folder's step and saved time, from trainer_state.json (written last by the Trainer),
    else its manifest, else its name and its newest file (a save cut short)."""
    state_file = os.path.join(folder, TRAINER_STATE)
    try:
        with open(state_file) as f:
            state = json.load(f)
        step = int(state["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        state, step = None, None
    try:
        found = manifest.read(folder)
    except manifest.ManifestError:
        found = None
    if step is None:
        step = found.step if found is not None else named_step
    if state is not None:
        # trainer_state.json is written last, so its mtime is the fallback for a checkpoint without our stamp.
        saved_at, stamped = saved_time(_callback_state(state, callback).get(SAVED_AT_ATTR), state_file)
        return Checkpoint(folder, step, saved_at, stamped)
    stamp = found.saved_at if found is not None else None
    return Checkpoint(folder, step, stamp if stamp is not None else newest_mtime(folder), stamp is not None)


def checkpoints(output_dir: str, callback: str, now: int | None) -> list[Checkpoint]:
    """The checkpoint-N folders of output_dir, whole or not, at steps up to `now` (a later step is another
    run's). A folder that is a link out of output_dir is not followed."""
    try:
        names = os.listdir(output_dir)
    except OSError:
        return []
    found = []
    for name in sorted(names):
        path = os.path.join(output_dir, name)
        match = _FOLDER.match(name)
        if not match or not os.path.isdir(path) or (os.path.islink(path) and not manifest.inside(path, output_dir)):
            continue
        try:
            c = _describe(path, callback, int(match.group(1)))
        except OSError:
            continue  # removed while listing (the Trainer's save_total_limit): not a checkpoint any more
        if now is not None and c.step is not None and c.step > now:
            continue
        found.append(c)
    return found


def _weights(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for name in hf_weights(folder) or ():
        path = os.path.join(folder, name)
        out.update(load_file(path, device="cpu") if name.endswith(".safetensors")
                   else torch.load(path, map_location="cpu", weights_only=True))
    if not out:
        raise ValueError("no weights")
    return out


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
    scaler: Any = getattr(optimizer, "scaler", None)
    try:
        weights = _weights(folder)
        _check_keys(model, weights)
        opt_state = torch.load(os.path.join(folder, OPTIMIZER), map_location="cpu", weights_only=True)
        sched_state = torch.load(os.path.join(folder, SCHEDULER), weights_only=True)
        # accelerate keeps the AMP GradScaler on its optimizer wrapper (the Trainer saves it as scaler.pt).
        scaler_file = os.path.join(folder, SCALER)
        scaler_state = torch.load(scaler_file, weights_only=True) \
            if scaler is not None and os.path.isfile(scaler_file) else None
        with open(os.path.join(folder, TRAINER_STATE)) as f:
            client_state = _callback_state(json.load(f), callback).get("_trainmedic_saved")
    except ActionFailed:
        raise
    except Exception as exc:
        raise ActionFailed(f"The checkpoint {folder} could not be read ({type(exc).__name__}: {exc}); nothing "
                           "was restored.") from None
    with torch.no_grad():
        model.load_state_dict(weights, strict=False)  # the keys were checked above; tied ones follow their twin
    optimizer.load_state_dict(opt_state)  # torch moves the state onto each parameter's device
    if scheduler is not None:
        scheduler.load_state_dict(sched_state)
    if scaler_state is not None:
        scaler.load_state_dict(scaler_state)
    return client_state
