"""Checkpoints that are whole: save one with its manifest, verify one, and find the newest that verifies.

For plain PyTorch loops (the Transformers and Lightning callbacks do the same by themselves)::

    from trainmedic.client import checkpoints

    checkpoints.save({"model": model.state_dict(), "opt": opt.state_dict(), "trainmedic": rc.state_dict()},
                     f"checkpoints/step-{step}.pt", step=step)
    found = checkpoints.newest_good("checkpoints", saved_before=rc.alert_start)

torch is imported only when a checkpoint is written or opened, so importing this module stays light.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import time
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from . import manifest
from .manifest import MANIFEST, SUFFIX, Entry, Manifest, ManifestError, Why

__all__ = ["Checkpoint", "Found", "PassedOver", "Why", "newest_good", "save", "verify"]

# A Hugging Face Trainer's checkpoint folder: what it is made of.
TRAINER_STATE = "trainer_state.json"
OPTIMIZER, SCHEDULER, SCALER = "optimizer.pt", "scheduler.pt", "scaler.pt"
SAFE_WEIGHTS, SAFE_INDEX = "model.safetensors", "model.safetensors.index.json"
WEIGHTS, WEIGHTS_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
# Files newest_good takes for checkpoints even without a manifest beside them.
FILE_KINDS = (".pt", ".pth", ".ckpt", ".bin", ".safetensors")
# A safetensors header is a few kilobytes per hundred tensors; a larger length is a damaged file.
MAX_HEADER = 100 * 1024 * 1024
_NUMBER = re.compile(r"(\d+)")


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint a run saved: where (as the run names it), at which step (None: unknown), and when
    (seconds since the epoch; stamped False when that is a file's mtime, not the time it was saved)."""

    path: str
    step: int | None
    saved_at: float
    stamped: bool = True


@dataclass(frozen=True)
class PassedOver:
    """A newer checkpoint that did not verify, and why."""

    path: str
    why: Why

    def as_dict(self) -> dict[str, str]:
        return {"path": self.path, "why": self.why.value}


@dataclass(frozen=True)
class Found:
    """newest_good's answer: the newest checkpoint that verifies (path None when none does), and every newer
    one it passed over, newest first."""

    path: str | None
    step: int | None
    passed_over: tuple[PassedOver, ...]


def _safetensors_whole(path: str) -> bool:
    """Whether a safetensors file's header parses and its tensors end exactly at the end of the file."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n > min(size - 8, MAX_HEADER):
                return False
            header = json.loads(f.read(n))
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
        return 8 + n + max(ends, default=0) == size
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        return False


def _torch_opens(path: str) -> bool:
    """Whether torch.load(weights_only=True) reads the file on the CPU (memory-mapped, for the zip format)."""
    try:
        import torch

        torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
        return True
    except Exception:  # any failure to read it is the checkpoint's fault: it does not verify
        return False


def _file_opens(path: str) -> bool:
    return _safetensors_whole(path) if path.endswith(".safetensors") else _torch_opens(path)


def hf_weights(folder: str) -> list[str] | None:
    """The weights files a Trainer checkpoint folder should hold (from its index when it has one); None when
    its index does not parse."""
    for index in (SAFE_INDEX, WEIGHTS_INDEX):
        path = os.path.join(folder, index)
        if os.path.isfile(path):
            try:
                with open(path) as f:
                    shards = json.load(f)["weight_map"].values()
                return sorted({os.path.basename(str(s)) for s in shards})
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                return None
    for single in (SAFE_WEIGHTS, WEIGHTS):
        if os.path.isfile(os.path.join(folder, single)):
            return [single]
    return []


def _hf_folder(folder: str) -> Why | None:
    """A Trainer checkpoint folder without a manifest: its files complete, and its weights and states open."""
    weights = hf_weights(folder)
    if weights is None:
        return Why.UNREADABLE
    needed = [TRAINER_STATE, OPTIMIZER, SCHEDULER, *weights]
    if not weights or not all(os.path.isfile(os.path.join(folder, f)) for f in needed):
        return Why.INCOMPLETE
    try:
        with open(os.path.join(folder, TRAINER_STATE)) as f:
            json.load(f)
    except (OSError, ValueError):
        return Why.UNREADABLE
    if not all(_file_opens(os.path.join(folder, f)) for f in (*weights, OPTIMIZER, SCHEDULER)):
        return Why.UNREADABLE
    return None


def verify(path: str | os.PathLike[str]) -> Why | None:
    """None when the checkpoint (a folder or a file) is whole, else why not; never raises.

    With a manifest: every file it lists is present with that size and SHA-256. Without one: a Trainer
    checkpoint folder holds the weights its index names, trainer_state.json, the optimizer and scheduler
    files, and they open; a file opens (a safetensors header parses and fits the file; torch.load with
    weights_only=True succeeds, on the CPU, memory-mapped).
    """
    path = os.fspath(path)
    try:
        found = manifest.read(path)
        if found is not None:
            return manifest.check(found, manifest.location(path)[1])
        if os.path.isdir(path):
            return _hf_folder(path)
        if not os.path.isfile(path):
            return Why.MISSING_FILE
        return None if _file_opens(path) else Why.UNREADABLE
    except ManifestError:
        return Why.UNREADABLE
    except Exception:  # a checkpoint that cannot even be examined is not one to restore
        return Why.UNREADABLE


def newest_first(found: Iterable[Checkpoint]) -> list[Checkpoint]:
    """Newest saved first; ties go to the higher step, then the path (every rank orders alike)."""
    return sorted(found, key=lambda c: (c.saved_at, -1 if c.step is None else c.step, c.path), reverse=True)


def first_whole(candidates: Iterable[Checkpoint],
                check: Callable[[str], Why | None] = verify) -> tuple[Checkpoint | None, tuple[PassedOver, ...]]:
    """The first candidate that verifies (give them newest first: verifying stops there, so a large
    checkpoint's digests are read only as far as needed), and the ones before it with why."""
    passed: list[PassedOver] = []
    for c in candidates:
        why = check(c.path)
        if why is None:
            return c, tuple(passed)
        passed.append(PassedOver(c.path, why))
    return None, tuple(passed)


def newest_mtime(path: str) -> float:
    """A file's mtime; a folder's newest file's (what it holds was written then)."""
    if not os.path.isdir(path):
        return os.path.getmtime(path)
    times = [os.path.getmtime(path)]
    with os.scandir(path) as entries:
        times += [e.stat(follow_symlinks=False).st_mtime for e in entries if e.is_file(follow_symlinks=False)]
    return max(times)


def _hf_step(folder: str) -> int | None:
    try:
        with open(os.path.join(folder, TRAINER_STATE)) as f:
            return int(json.load(f)["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _name_step(name: str) -> int | None:
    numbers = _NUMBER.findall(os.path.splitext(name)[0])
    return int(numbers[-1]) if numbers else None


def _candidate(path: str) -> Checkpoint:
    """A checkpoint as newest_good orders it: its manifest's step and stamp; else a Trainer folder's step or
    the last number in its name, and its mtime."""
    try:
        m = manifest.read(path)
    except ManifestError:
        m = None
    step = m.step if m is not None else _hf_step(path) if os.path.isdir(path) else None
    if step is None:
        step = _name_step(os.path.basename(path))
    stamp = m.saved_at if m is not None else None
    return Checkpoint(path, step, stamp if stamp is not None else newest_mtime(path), stamp is not None)


def _is_candidate(path: str, name: str) -> bool:
    if os.path.isdir(path):
        return os.path.exists(os.path.join(path, MANIFEST)) or os.path.exists(os.path.join(path, TRAINER_STATE)) \
            or name.startswith("checkpoint-")
    return name.endswith(FILE_KINDS) or os.path.exists(manifest.location(path)[0])


def newest_good(folder: str | os.PathLike[str], before_step: int | None = None,
                saved_before: float | None = None) -> Found:
    """The newest checkpoint in `folder` that verifies, and why each newer one did not; never raises.

    The checkpoints are the files and folders saved with a manifest, files ending .pt, .pth, .ckpt, .bin or
    .safetensors, and Trainer `checkpoint-N` folders; newest by the time their manifest says they were saved,
    else their mtime. `before_step` keeps those saved at a lower step (the manifest's, else the last number in
    the name); `saved_before` (seconds since the epoch, such as `rc.alert_start`) those saved earlier. A link
    that leads out of the folder is never followed.
    """
    folder = os.fspath(folder)
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return Found(None, None, ())
    found = []
    for name in names:
        path = os.path.join(folder, name)
        if name.startswith(".") or name.endswith(SUFFIX):
            continue  # temporary files and manifests
        if os.path.islink(path) and not manifest.inside(path, folder):
            continue
        try:
            if not _is_candidate(path, name):
                continue
            c = _candidate(path)
        except OSError:
            continue  # gone while listing: not a checkpoint any more
        if before_step is not None and (c.step is None or c.step >= before_step):
            continue
        if saved_before is not None and c.saved_at >= saved_before:
            continue
        found.append(c)
    chosen, passed = first_whole(newest_first(found))
    return Found(chosen.path if chosen else None, chosen.step if chosen else None, passed)


class _Hashing:
    """A file that hashes what is written to it, so save() reads nothing back."""

    def __init__(self, f: Any):
        self.f, self.h, self.size = f, hashlib.sha256(), 0

    def write(self, data: Any) -> int:
        self.h.update(data)
        n: int = self.f.write(data)
        self.size += n
        return n

    def flush(self) -> None:
        self.f.flush()


def save(obj: Any, path: str | os.PathLike[str], step: int) -> str:
    """torch.save `obj` to `path` and write its manifest beside it (NAME.trainmedic.json), each under a
    temporary name, fsynced, then renamed into place: a crash leaves the old checkpoint or the whole new one.
    Returns the path. ValueError for a step that is not a whole number of at least 0."""
    import torch

    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a whole number of at least 0, not {step!r}")
    path = os.fspath(path)
    name = os.path.basename(path)
    saved_at = time.time()
    manifest.remove(path)  # never an old manifest beside a new file
    written: list[_Hashing] = []

    def fill(f: Any) -> None:
        written.append(_Hashing(f))
        torch.save(obj, written[0])  # type: ignore[arg-type]  # torch needs only write() and flush()

    manifest.write_atomically(path, fill)
    out = written[0]
    manifest.write(path, Manifest(step, (Entry(name, out.size, out.h.hexdigest()),), {"saved_at": saved_at}))
    return path
