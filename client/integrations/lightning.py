"""PyTorch Lightning integration: apply trainmedic commands after every training batch."""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

try:
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.utilities.data import extract_batch_size
except ImportError:  # the older standalone package name
    from pytorch_lightning.callbacks import Callback  # type: ignore[assignment]
    from pytorch_lightning.utilities.data import extract_batch_size

from .. import manifest
from . import _pl_checkpoints as ckpts
from ._common import ClientHolder
from ._manifests import ManifestWriter
from ._rollback import SAVED_AT, alert_began, choose, on_rank0, rolled_back

log = logging.getLogger("trainmedic.client")


class TrainMedicCallback(ClientHolder, Callback):
    """A Lightning Callback that runs a RemediationClient on trainer.optimizers and trainer.lr_scheduler_configs.

    save_checkpoint calls trainer.save_checkpoint (into checkpoint_dir, else the ModelCheckpoint folder,
    else default_root_dir/checkpoints), stop_training sets trainer.should_stop and rollback_checkpoint
    restores model, optimizers, LR schedulers and precision (scaler) state from the newest .ckpt in those
    folders saved before the alert began that verifies, going on with the next batches, unless you register
    your own handler; every rank of a distributed run applies each command at the same global step.
    Every checkpoint trainer.save_checkpoint writes gets NAME.trainmedic.json beside NAME.ckpt once it is
    complete (hashed off the training thread, at the lowest CPU priority, by rank 0).
    What the client applied is saved in every checkpoint (Callback.state_dict, with the time it was saved)
    and restored by `trainer.fit(ckpt_path=...)`, so a resume neither repeats a change nor loses one.
    The training signals go to the client by themselves: each batch's loss (what training_step returned, as a
    tensor the client reads once in ten batches), its size, and the gradient norm when the module logs one
    (`self.log("grad_norm", ...)`, or Lightning's `grad_norm()` helper's total, from on_before_optimizer_step).
    """

    def __init__(self, job: str | None = None, checkpoint_dir: str | os.PathLike[str] | None = None,
                 **client_kwargs: Any):
        super().__init__(job, **client_kwargs)
        self.checkpoint_dir = checkpoint_dir
        self._trainer: Any = None
        self._manifests = ManifestWriter()
        self._stamp: dict[str, Any] = {}  # what the latest state_dict() saved: the manifest repeats it

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # Before any save of this fit: every checkpoint written through the trainer gets its manifest.
        if getattr(trainer.save_checkpoint, "_trainmedic", False):
            return
        try:
            trainer.save_checkpoint = self._with_manifest(trainer, trainer.save_checkpoint)
        except Exception as exc:  # a trainer that refuses the attribute: its checkpoints are judged by their files
            log.warning("trainmedic: checkpoints will have no manifest (%s: %s)", type(exc).__name__, exc)

    def _with_manifest(self, trainer: Any, save: Callable[..., Any]) -> Callable[..., Any]:
        """trainer.save_checkpoint, then (rank 0, after Lightning's own barrier) the checkpoint's manifest."""
        def save_checkpoint(filepath: Any, *args: Any, **kwargs: Any) -> Any:
            path = self._manifest_target(trainer, filepath)
            if path is not None:
                manifest.remove(path)  # a checkpoint written again never sits beside its old manifest
            out = save(filepath, *args, **kwargs)
            if path is not None:
                self._manifests.submit(path, int(trainer.global_step), self._stamp)
            return out
        save_checkpoint._trainmedic = True  # type: ignore[attr-defined]
        return save_checkpoint

    @staticmethod
    def _manifest_target(trainer: Any, filepath: Any) -> str | None:
        """The local checkpoint path rank 0 writes a manifest for, or None (another rank, a remote path, or an
        asynchronous CheckpointIO that may still be writing when save_checkpoint returns)."""
        try:
            path = os.fspath(filepath)
            io_kinds = {t.__name__ for t in type(getattr(trainer.strategy, "checkpoint_io", None)).__mro__}
            if not trainer.is_global_zero or "://" in str(path) or "AsyncCheckpointIO" in io_kinds:
                return None
            return str(path)
        except Exception:
            return None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._trainer = trainer
        optimizers = list(trainer.optimizers)
        schedulers = [cfg.scheduler for cfg in trainer.lr_scheduler_configs]
        self._attach(optimizers, schedulers, {"save_checkpoint": self._save, "stop_training": self._stop,
                                              "rollback_checkpoint": self._rollback})

    def _folder(self) -> str:
        if self.checkpoint_dir is not None:
            return os.fspath(self.checkpoint_dir)
        ckpt = getattr(self._trainer, "checkpoint_callback", None)
        if ckpt is not None and getattr(ckpt, "dirpath", None):
            return str(os.fspath(ckpt.dirpath))
        return os.path.join(self._trainer.default_root_dir, "checkpoints")

    def _save(self, params: dict[str, Any]) -> dict[str, Any]:
        # The name is built from the step number only: nothing from an alert reaches the path.
        step = int(self._trainer.global_step)
        path = os.path.join(self._folder(), f"trainmedic-step={step}.ckpt")
        self._trainer.save_checkpoint(path)  # every rank calls it at the same step, as Lightning requires
        return {"path": path, "step": step}

    def _stop(self, params: dict[str, Any]) -> dict[str, Any]:
        self._trainer.should_stop = True
        return {"should_stop": True, "step": int(self._trainer.global_step)}

    def _folders(self) -> list[str]:
        """Every folder this run's checkpoints go to: checkpoint_dir, each ModelCheckpoint's, the default."""
        out = [os.fspath(self.checkpoint_dir)] if self.checkpoint_dir is not None else []
        for cb in getattr(self._trainer, "checkpoint_callbacks", None) or []:
            if getattr(cb, "dirpath", None):
                out.append(str(os.fspath(cb.dirpath)))
        out.append(os.path.join(self._trainer.default_root_dir, "checkpoints"))
        return list(dict.fromkeys(out))

    def _rollback(self, params: dict[str, Any]) -> dict[str, Any]:
        client = self.client
        assert client is not None  # a handler runs inside the client's poll
        before = alert_began(client)
        step = int(self._trainer.global_step)
        folders = self._folders()
        choice = on_rank0(lambda: choose(ckpts.checkpoints(folders, self.state_key, step), before,
                                         " or ".join(folders)))
        saved = ckpts.restore(self._trainer, choice.checkpoint.path, self.state_key)
        client.rolled_back_to(saved)
        return rolled_back(choice, step).result()

    def state_dict(self) -> dict[str, Any]:
        # Lightning asks for this as it saves a checkpoint: the stamp rollback_checkpoint chooses by.
        self._stamp = {SAVED_AT: time.time(), "job": self.job, "state": self.trainmedic_state()}
        return {"trainmedic": self._stamp["state"], SAVED_AT: self._stamp[SAVED_AT]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.restore(state_dict.get("trainmedic"))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        client = self.client
        if client is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if loss is not None:
            accumulate = getattr(trainer, "accumulate_grad_batches", 1)
            if isinstance(accumulate, int) and accumulate > 1:
                loss = loss * accumulate  # Lightning hands back the loss divided for accumulation
        client.poll(step=int(trainer.global_step), loss=loss, grad_norm=_logged_grad_norm(trainer),
                    samples=_batch_size(batch))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.close()  # a manifest still being hashed is finished by its own child process

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.close()


# Where a module's logged gradient norm is found: its own name, and Lightning's grad_norm() helper's total.
GRAD_NORM_KEYS = ("grad_norm", "grad_2.0_norm_total", "train/grad_norm")


def _logged_grad_norm(trainer: Any) -> Any:
    """The gradient norm the module logged (a tensor or a number), or None."""
    try:
        metrics = trainer.callback_metrics
    except Exception:  # no loop running, or a trainer without logging: no norm
        return None
    for key in GRAD_NORM_KEYS:
        value = metrics.get(key)
        if value is not None:
            return value
    return None


def _batch_size(batch: Any) -> int | None:
    """The number of samples in a batch, as Lightning counts them for logging (None if it cannot tell)."""
    try:
        return int(extract_batch_size(batch))
    except Exception:  # a batch it cannot measure: throughput is then unknown
        return None
