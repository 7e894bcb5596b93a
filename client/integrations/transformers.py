"""Hugging Face Trainer integration: apply trainmedic commands at every optimizer step (on_step_end)."""
from __future__ import annotations

from typing import Any, Callable

from transformers import TrainerCallback

from ..applier import Handler, RemediationClient


class TrainMedicCallback(TrainerCallback):
    """A TrainerCallback that runs a RemediationClient on the Trainer's optimizer and LR scheduler.

    save_checkpoint sets control.should_save and stop_training sets control.should_training_stop
    (unless you register your own handler for them); every rank of a distributed run applies each
    command at the same global step.
    """

    def __init__(self, job: str | None = None, **client_kwargs: Any):
        self.job = job
        self.client_kwargs = client_kwargs
        self.client: RemediationClient | None = None
        self._handlers: dict[str, Handler] = {}
        self._want_save = False
        self._want_stop = False

    def handler(self, action: str) -> Callable[[Handler], Handler]:
        """Decorator: register fn(params) -> result dict for an action (before or during training)."""
        def register(fn: Handler) -> Handler:
            self._handlers[action] = fn
            if self.client is not None:
                self.client.register(action, fn)
            return fn
        return register

    def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None,
                       lr_scheduler: Any = None, **kwargs: Any) -> None:
        if self.client is not None:  # train() called again: same client, the Trainer's current objects
            self.client.optimizer, self.client.scheduler = optimizer, lr_scheduler
            return
        self.client = RemediationClient(job=self.job, optimizer=optimizer, scheduler=lr_scheduler,
                                        **self.client_kwargs)
        self.client.register("save_checkpoint", self._save)
        self.client.register("stop_training", self._stop)
        for action, fn in self._handlers.items():
            self.client.register(action, fn)

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

    def close(self) -> None:
        """Stop the client's background threads (the Trainer's end of training does this)."""
        if self.client is not None:
            self.client.close()
            self.client = None
