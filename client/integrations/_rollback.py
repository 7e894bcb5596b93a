"""What both callbacks' built-in rollback_checkpoint shares: which checkpoint to restore, and what it reports."""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any, TypeVar
from collections.abc import Callable, Iterable

from ..checkpoints import Checkpoint, PassedOver, first_whole, newest_first
from ..receiver.applier import ActionFailed
from ..wire.protocol import rfc3339

# The key under which a callback keeps, in its own checkpoint state, the wall-clock time the checkpoint was saved.
SAVED_AT = "saved_at"
# The reason of a rollback that found nothing whole to restore.
NO_GOOD_CHECKPOINT = "no_good_checkpoint"
T = TypeVar("T")


@dataclass(frozen=True)
class Choice:
    """The checkpoint to restore, and the newer ones from before the alert that did not verify."""

    checkpoint: Checkpoint
    passed_over: tuple[PassedOver, ...]


@dataclass(frozen=True)
class Rollback:
    """What a rollback did, as the action's result."""

    checkpoint: str
    checkpoint_step: int
    skipped_batches: int
    stamped: bool
    passed_over: tuple[PassedOver, ...] = ()

    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = {"checkpoint": self.checkpoint, "checkpoint_step": self.checkpoint_step,
                               "skipped_batches": self.skipped_batches,
                               "passed_over": [p.as_dict() for p in self.passed_over]}
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


def choose(checkpoints: Iterable[Checkpoint], before: float, where: str) -> Choice:
    """The newest checkpoint saved strictly before `before` that verifies (checked newest first, stopping at
    the first whole one); ActionFailed (one sentence, reason no_good_checkpoint) when there is none."""
    found = list(checkpoints)
    old_enough = newest_first(c for c in found if c.saved_at < before)
    if not old_enough:
        if not found:
            raise ActionFailed(f"No checkpoint was found in {where}, so there is nothing to roll back to.",
                               reason=NO_GOOD_CHECKPOINT, passed_over=[])
        raise ActionFailed(f"None of the {len(found)} checkpoints in {where} was saved before the alert began "
                           f"({rfc3339(before)}), so there is nothing to roll back to.", reason=NO_GOOD_CHECKPOINT,
                           passed_over=[])
    chosen, passed = first_whole(old_enough)
    if chosen is None:
        which = f"None of the {len(old_enough)} checkpoints" if len(old_enough) > 1 else "The one checkpoint"
        raise ActionFailed(f"{which} in {where} saved before the alert began ({rfc3339(before)}) "
                           f"{'is' if len(old_enough) > 1 else 'is not'} whole, so nothing was restored.",
                           reason=NO_GOOD_CHECKPOINT, passed_over=[p.as_dict() for p in passed])
    return Choice(chosen, passed)


def rolled_back(choice: Choice, step: int | None) -> Rollback:
    """The result for a rollback to the chosen checkpoint at global step `step` (the batches since it are
    skipped)."""
    chosen = choice.checkpoint
    saved_step = chosen.step or 0
    now = saved_step if step is None else step
    return Rollback(chosen.path, saved_step, max(0, now - saved_step), chosen.stamped, choice.passed_over)


def on_rank0(decide: Callable[[], T]) -> T:
    """decide() on rank 0 alone, its answer (or its ActionFailed) handed to every rank.

    Every rank applies the rollback at the same step, so every rank is here: rank 0 reads and verifies the
    checkpoints, and one broadcast makes every rank restore the same one, even should a file change while the
    ranks look at it (ranks that restored different weights would train on, silently apart).
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return decide()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", decide())
        except ActionFailed as exc:
            box[0] = ("failed", exc.message, exc.reason, exc.result)
        except Exception as exc:  # rank 0's bug fails the action on every rank, never leaves a rank waiting
            box[0] = ("failed", f"{type(exc).__name__}: {exc}", None, {})
    dist.broadcast_object_list(box, src=0)
    kind, *rest = box[0]
    if kind == "ok":
        answer: T = rest[0]
        return answer
    message, reason, result = rest
    raise ActionFailed(message, reason=reason, **{k: v for k, v in result.items() if k != "error"})
