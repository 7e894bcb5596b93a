"""PyTorch Lightning integration: apply trainmedic commands after every training batch."""
from __future__ import annotations

import os
from typing import Any

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the older standalone package name
    from pytorch_lightning.callbacks import Callback  # type: ignore[assignment]

from ._common import ClientHolder


class TrainMedicCallback(ClientHolder, Callback):
    """A Lightning Callback that runs a RemediationClient on trainer.optimizers and trainer.lr_scheduler_configs.

    save_checkpoint calls trainer.save_checkpoint (into checkpoint_dir, else the ModelCheckpoint folder,
    else default_root_dir/checkpoints) and stop_training sets trainer.should_stop, unless you register
    your own handler; every rank of a distributed run applies each command at the same global step.
    What the client applied is saved in every checkpoint (Callback.state_dict) and restored by
    `trainer.fit(ckpt_path=...)`, so a resume neither repeats a change nor loses one.
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
        self._attach(optimizers, schedulers, {"save_checkpoint": self._save, "stop_training": self._stop})

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

    def state_dict(self) -> dict[str, Any]:
        return {"trainmedic": self.trainmedic_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.restore(state_dict.get("trainmedic"))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.client is not None:
            self.client.poll(step=int(trainer.global_step))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.close()
