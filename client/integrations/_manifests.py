"""The callbacks' manifests: a background thread has each saved checkpoint hashed and writes its manifest last,
so no training step waits for the hashing, and nothing here ever raises into the loop.

The hashing and the writing run in a child Python process at the lowest CPU priority (SCHED_IDLE where the
system has it, else nice 19), which the thread waits on: it uses CPU time nothing else wants, so on a busy host
a manifest takes longer to appear rather than a step taking longer; it shares no GIL with the training thread
(a low-priority thread in the training process would, and could hold the training thread up each time the GIL
is handed to it while the CPUs are busy); and it finishes its manifest should the training process end first.
Where no child can be started, the thread hashes by itself.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .. import manifest

log = logging.getLogger("trainmedic.client")


@dataclass(frozen=True)
class _Job:
    checkpoint: str
    step: int
    trainmedic: Mapping[str, Any]


def after_every_rank() -> None:
    """Wait until every rank is here (each rank's files of the checkpoint are in); alone, return at once."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class _Gone(Exception):
    """The checkpoint changed or went while it was hashed: that save's manifest will do."""


def _in_child(job: _Job) -> str | None:
    """Run manifest.py as a child process at nice 19 (standard library only: -I -S); the manifest's path,
    or None when no child could be started (the caller hashes by itself)."""
    if not sys.executable or getattr(sys, "frozen", False):  # no interpreter to run it with
        return None
    try:
        done = subprocess.run([sys.executable, "-I", "-S", manifest.__file__], capture_output=True, text=True,
                              input=json.dumps({"checkpoint": job.checkpoint, "step": job.step,
                                                "trainmedic": dict(job.trainmedic)}, default=str), check=False)
    except OSError:
        return None
    if done.returncode == 3:
        raise _Gone(job.checkpoint)
    if done.returncode != 0:
        raise OSError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}")
    return done.stdout.strip()


class ManifestWriter:
    """Hashes each checkpoint handed to it, in order, in one daemon thread, and writes its manifest."""

    def __init__(self) -> None:
        self._jobs: deque[_Job] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._thread: threading.Thread | None = None
        self.written: list[str] = []  # manifests written, oldest first (the last few: for logs and tests)

    def submit(self, checkpoint: str, step: int, trainmedic: Mapping[str, Any]) -> None:
        """Queue a checkpoint the framework finished writing (returns at once, never raises)."""
        try:
            with self._cond:
                self._jobs.append(_Job(checkpoint, step, dict(trainmedic)))
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(target=self._run, name="trainmedic-manifests", daemon=True)
                    self._thread.start()
                self._cond.notify_all()
        except Exception as exc:  # no thread to be had: this checkpoint is judged by its files
            log.warning("trainmedic: no manifest for %s (%s: %s)", checkpoint, type(exc).__name__, exc)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every queued manifest is written (or given up); False when time ran out first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs and not self._busy, timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._cond.wait_for(lambda: bool(self._jobs), timeout=30.0):
                    self._thread = None  # idle: a later submit starts a new thread
                    return
                job = self._jobs.popleft()
                self._busy = True
            try:
                self._write(job)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _write(self, job: _Job) -> None:
        try:
            path = _in_child(job) or manifest.write_if_still(job.checkpoint, job.step, job.trainmedic)
        except (FileNotFoundError, manifest.Changed, _Gone):
            # Removed (save_total_limit, save_top_k) or written again while hashed: that save's manifest will do.
            log.debug("trainmedic: no manifest for %s: it changed or went while hashed", job.checkpoint)
            return
        except Exception as exc:  # a full disk, a read-only folder: the checkpoint is then judged by its files
            log.warning("trainmedic: could not write the manifest of %s (%s: %s)", job.checkpoint,
                        type(exc).__name__, exc)
            return
        self.written = [*self.written[-99:], path]
        if os.path.isfile(job.checkpoint):
            _drop_orphans(os.path.dirname(job.checkpoint) or ".")


def _drop_orphans(folder: str) -> None:
    """Remove the manifests beside checkpoint files the framework has since removed (save_top_k)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    stems = {os.path.splitext(n)[0] for n in names if not n.endswith(manifest.SUFFIX)}
    for name in names:
        if name.endswith(manifest.SUFFIX) and name[:-len(manifest.SUFFIX)] not in stems:
            try:
                os.unlink(os.path.join(folder, name))
            except OSError:
                pass
