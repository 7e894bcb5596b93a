"""PyTorch Lightning integration: apply trainmedic commands after every training batch."""
from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

try:
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.utilities.data import extract_batch_size
except ImportError:  # the older standalone package name
    from pytorch_lightning.callbacks import Callback  # type: ignore[assignment]
    from pytorch_lightning.utilities.data import extract_batch_size

from . import _pl_checkpoints as ckpts
from ._common import ClientHolder
from ._rollback import SAVED_AT, alert_began, choose, rolled_back


class TrainMedicCallback(ClientHolder, Callback):
    """A Lightning Callback that runs a RemediationClient on trainer.optimizers and trainer.lr_scheduler_configs.

    save_checkpoint calls trainer.save_checkpoint (into checkpoint_dir, else the ModelCheckpoint folder,
    else default_root_dir/checkpoints), stop_training sets trainer.should_stop and rollback_checkpoint
    restores model, optimizers, LR schedulers and precision (scaler) state from the newest .ckpt in those
    folders saved before the alert began, going on with the next batches, unless you register your own
    handler; every rank of a distributed run applies each command at the same global step.
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
        found = ckpts.checkpoints(self._folders(), self.state_key, step)
        chosen = choose(found, before, " or ".join(self._folders()))
        saved = ckpts.restore(self._trainer, chosen.path, self.state_key)
        client.rolled_back_to(saved)
        return rolled_back(chosen, step).result()

    def state_dict(self) -> dict[str, Any]:
        # Lightning asks for this as it saves a checkpoint: the stamp rollback_checkpoint chooses by.
        return {"trainmedic": self.trainmedic_state(), SAVED_AT: time.time()}

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
        self.close()

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
