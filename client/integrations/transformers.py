"""Hugging Face Trainer integration: apply trainmedic commands at every optimizer step (on_step_end)."""
from __future__ import annotations

import logging
import os
import time
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from .. import manifest
from . import _hf_checkpoints as ckpts
from ._common import ClientHolder
from ._manifests import ManifestWriter, after_every_rank
from ._rollback import SAVED_AT, alert_began, choose, on_rank0, rolled_back

log = logging.getLogger("trainmedic.client")


class TrainMedicCallback(ClientHolder, TrainerCallback, ExportableState):
    """A TrainerCallback that runs a RemediationClient on the Trainer's optimizer and LR scheduler.

    save_checkpoint sets control.should_save, stop_training sets control.should_training_stop and
    rollback_checkpoint restores model, optimizer, scheduler and scaler from the newest output_dir/checkpoint-N
    saved before the alert began that verifies, going on with the next batches (unless you register your own
    handler for them); every rank of a distributed run applies each command at the same global step. Every
    checkpoint gets checkpoint-N/trainmedic.json once every rank's files are in (hashed off the training
    thread, at the lowest CPU priority, by the process that saves). What the client
    applied is saved with every checkpoint (in trainer_state.json, as an ExportableState, with the time it was
    saved) and restored by `trainer.train(resume_from_checkpoint=...)`. The training signals go to the client
    by themselves: each step's samples (the batch times the accumulation steps), and every loss and gradient
    norm the Trainer logs (every `logging_steps`: the detectors judge each logged loss).
    """

    def __init__(self, job: str | None = None, **client_kwargs: Any):
        super().__init__(job, **client_kwargs)
        self._want_save = False
        self._want_stop = False
        self._args: Any = None
        self._model: Any = None
        # The latest logged loss and gradient norm not yet passed to the client, and each step's samples.
        self._loss: float | None = None
        self._grad_norm: float | None = None
        self._samples: int | None = None
        self._manifests = ManifestWriter()
        self._stamp: dict[str, Any] = {}  # what the latest state() saved: the manifest repeats it

    def state(self) -> dict[str, Any]:
        """What Trainer._save_checkpoint writes into trainer_state.json for this callback."""
        # The Trainer asks for this as it saves a checkpoint: the stamp rollback_checkpoint chooses by.
        self._stamp = {SAVED_AT: time.time(), "job": self.job, "state": self.trainmedic_state()}
        return {"args": {"job": self.job}, "attributes": {"_trainmedic_saved": self._stamp["state"],
                                                          ckpts.SAVED_AT_ATTR: self._stamp[SAVED_AT]}}

    def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None,
                       lr_scheduler: Any = None, **kwargs: Any) -> None:
        # A resumed TrainerState holds what state() returned at that checkpoint (a fresh run holds None).
        saved = (getattr(state, "stateful_callbacks", None) or {}).get(type(self).__name__)
        saved = saved[-1] if isinstance(saved, list) and saved else saved
        if isinstance(saved, dict):
            self.restore((saved.get("attributes") or {}).get("_trainmedic_saved"))
        self._args, self._model = args, kwargs.get("model")
        try:
            self._samples = int(args.train_batch_size) * int(args.gradient_accumulation_steps)
        except (AttributeError, TypeError, ValueError):
            self._samples = None
        self._attach(optimizer, lr_scheduler, {"save_checkpoint": self._save, "stop_training": self._stop,
                                               "rollback_checkpoint": self._rollback})

    def _save(self, params: dict[str, Any]) -> dict[str, Any]:
        self._want_save = True
        return {"control": "should_save", "step": self.client.step if self.client else None}

    def _stop(self, params: dict[str, Any]) -> dict[str, Any]:
        self._want_stop = True
        return {"control": "should_training_stop", "step": self.client.step if self.client else None}

    def _rollback(self, params: dict[str, Any]) -> dict[str, Any]:
        client = self.client
        assert client is not None  # a handler runs inside the client's poll
        ckpts.check_supported(self._args)
        before, out, name, step = alert_began(client), self._args.output_dir, type(self).__name__, client.step
        choice = on_rank0(lambda: choose(ckpts.checkpoints(out, name, step), before, out))
        saved = ckpts.restore(choice.checkpoint.path, self._model, client.optimizer, client.scheduler, name)
        client.rolled_back_to(saved)
        return rolled_back(choice, client.step).result()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The Trainer has written checkpoint-N; each rank its own files (rng_state_R.pth), with no barrier of
        # its own after them: meet here (every rank saves at the same step), then the saver hashes them all.
        try:
            after_every_rank()
            folder = ckpts.folder(args.output_dir, state.global_step)
            if args.should_save and os.path.isdir(folder):
                self._manifests.submit(folder, int(state.global_step), self._stamp)
        except Exception as exc:  # never into the loop: this checkpoint is then judged by its files
            log.warning("trainmedic: no manifest for checkpoint %s (%s: %s)", state.global_step,
                        type(exc).__name__, exc)

    @staticmethod
    def _forget_manifest(output_dir: Any, step: int) -> None:
        """A checkpoint saved again (a resumed run) never sits beside the manifest of its first save."""
        try:
            manifest.remove(ckpts.folder(output_dir, step))
        except Exception:  # no output folder to speak of: nothing to forget
            pass

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.client is None:
            return control
        loss, grad_norm = self._loss, self._grad_norm
        self._loss = self._grad_norm = None
        self.client.poll(step=state.global_step, loss=loss, grad_norm=grad_norm, samples=self._samples)
        # The Trainer saves and stops right after on_step_end, at this very step on every rank.
        if self._want_save:
            control.should_save = True
            self._want_save = False
        if control.should_save and args.should_save:
            self._forget_manifest(args.output_dir, state.global_step)
        if self._want_stop:
            control.should_training_stop = True
            self._want_stop = False
        return control

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        # The Trainer logs after on_step_end: the next step's poll passes these on (the mean loss since the
        # last log, and the norm it clipped the gradients by; an evaluation's logs carry neither key).
        if isinstance(logs, dict):
            self._loss = _number(logs.get("loss"), self._loss)
            self._grad_norm = _number(logs.get("grad_norm"), self._grad_norm)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()  # a manifest still being hashed is finished by its own child process


def _number(x: Any, otherwise: float | None) -> float | None:
    """A logged number as a float (a bool or anything else leaves `otherwise`)."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    return otherwise
