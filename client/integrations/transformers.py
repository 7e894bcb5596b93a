"""Hugging Face Trainer integration: apply trainmedic commands at every optimizer step (on_step_end)."""
from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from trainmedic.client.integrations._common import ClientHolder


class TrainMedicCallback(ClientHolder, TrainerCallback):
    """A TrainerCallback that runs a RemediationClient on the Trainer's optimizer and LR scheduler.

    save_checkpoint sets control.should_save and stop_training sets control.should_training_stop
    (unless you register your own handler for them); every rank of a distributed run applies each
    command at the same global step.
    """

    def __init__(self, job: str | None = None, **client_kwargs: Any):
        super().__init__(job, **client_kwargs)
        self._want_save = False
        self._want_stop = False

    def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None,
                       lr_scheduler: Any = None, **kwargs: Any) -> None:
        self._attach(optimizer, lr_scheduler, {"save_checkpoint": self._save, "stop_training": self._stop})

    def _save(self, params: dict) -> dict:
        self._want_save = True
        return {"control": "should_save", "step": self.client.step if self.client else None}

    def _stop(self, params: dict) -> dict:
        self._want_stop = True
        return {"control": "should_training_stop", "step": self.client.step if self.client else None}

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.client is None:
            return control
        self.client.poll(step=state.global_step)
        # The Trainer saves and stops right after on_step_end, at this very step on every rank.
        if self._want_save:
            control.should_save = True
            self._want_save = False
        if self._want_stop:
            control.should_training_stop = True
            self._want_stop = False
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()
