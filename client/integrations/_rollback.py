"""What both callbacks' built-in rollback_checkpoint shares: which checkpoint to restore, and what it reports."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any
from collections.abc import Iterable

from ..receiver.applier import ActionFailed
from ..wire.protocol import rfc3339

# The key under which a callback keeps, in its own checkpoint state, the wall-clock time the checkpoint was saved.
SAVED_AT = "saved_at"


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint the run saved: where, at which global step, and when (seconds since the epoch)."""

    path: str
    step: int
    saved_at: float
    # False when saved_at is the file's mtime: a checkpoint written before the callback stamped its own.
    stamped: bool = True


@dataclass(frozen=True)
class Rollback:
    """What a rollback did, as the action's result."""

    checkpoint: str
    checkpoint_step: int
    skipped_batches: int
    stamped: bool

    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = {"checkpoint": self.checkpoint, "checkpoint_step": self.checkpoint_step,
                               "skipped_batches": self.skipped_batches}
        if not self.stamped:
            out["saved_at_from"] = "mtime"
        return out


def saved_time(stamp: Any, fallback_file: str) -> tuple[float, bool]:
    """The checkpoint's own saved_at stamp, else the mtime of the file that completes it.

    The stamp is taken when the framework builds the checkpoint's state, and every rank reads it from the same
    file, so every rank decides alike. A checkpoint without one (saved before this version, or by a run without
    the callback) falls back to its file's mtime: later than the save began, so a checkpoint still being written
    when the alert began counts as saved after it, the safe side; and the same number on every rank of a shared
    file system.
    """
    if isinstance(stamp, (int, float)) and not isinstance(stamp, bool):
        return float(stamp), True
    return os.path.getmtime(fallback_file), False


def alert_began(client: Any) -> float:
    """Inside the rollback handler: when the alert behind the command began (now, should none be known)."""
    began = client.alert_start
    return time.time() if began is None else float(began)


def choose(checkpoints: Iterable[Checkpoint], before: float, where: str) -> Checkpoint:
    """The newest checkpoint saved strictly before `before`; ActionFailed (one sentence) when there is none."""
    found = list(checkpoints)
    old_enough = [c for c in found if c.saved_at < before]
    if not old_enough:
        if not found:
            raise ActionFailed(f"No checkpoint was found in {where}, so there is nothing to roll back to.")
        raise ActionFailed(f"None of the {len(found)} checkpoints in {where} was saved before the alert began "
                           f"({rfc3339(before)}), so there is nothing to roll back to.")
    # Ties (two stamps alike) go to the higher step, then the path: the same choice on every rank.
    return max(old_enough, key=lambda c: (c.saved_at, c.step, c.path))


def rolled_back(chosen: Checkpoint, step: int | None) -> Rollback:
    """The result for a rollback to `chosen` at global step `step` (the batches since it are skipped)."""
    now = chosen.step if step is None else step
    return Rollback(chosen.path, chosen.step, max(0, now - chosen.step), chosen.stamped)
