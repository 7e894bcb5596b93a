"""A checkpoint's manifest: every file it is made of, with its size and SHA-256, written last and atomically.

A checkpoint folder (a Hugging Face `checkpoint-N/`) holds its manifest as `trainmedic.json`, its paths relative
to the folder; a checkpoint file (`NAME.ckpt`, `NAME.pt`) has `NAME.trainmedic.json` beside it, its one path the
file's name. Nothing here imports torch: the node agent reads manifests too (sizes only, never digests).

This file uses the standard library only, so that it also runs as a program of its own
(`python -I -S manifest.py`, a job as JSON on stdin): the callbacks hash checkpoints in such a child process.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import PurePosixPath
from typing import Any

MANIFEST = "trainmedic.json"
SUFFIX = ".trainmedic.json"
# A manifest is a few lines per file; anything far larger is not one (and is not read whole into memory).
MAX_BYTES = 16 * 1024 * 1024
CHUNK = 1024 * 1024
_HEX = re.compile(r"^[0-9a-f]{64}$")


class Why(StrEnum):
    """Why a checkpoint does not verify (a rollback's `passed_over` and newest_good's reasons)."""

    MISSING_FILE = "missing_file"  # a file its manifest lists is gone
    SIZE_MISMATCH = "size_mismatch"  # a file its manifest lists has another size
    DIGEST_MISMATCH = "digest_mismatch"  # a file its manifest lists has another SHA-256
    INCOMPLETE = "incomplete"  # no manifest, and a file the framework writes is missing
    UNREADABLE = "unreadable"  # the manifest or the weights do not parse


class ManifestError(ValueError):
    """A manifest that does not parse, or that names a path outside its checkpoint."""


@dataclass(frozen=True)
class Entry:
    """One file of a checkpoint: its path relative to the manifest's folder, its size and SHA-256."""

    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """What a checkpoint was when it was saved."""

    step: int
    files: tuple[Entry, ...]
    trainmedic: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"step": self.step, "files": [{"path": e.path, "size": e.size, "sha256": e.sha256}
                                                        for e in self.files],
                           "trainmedic": dict(self.trainmedic)}, indent=1, sort_keys=True)

    @property
    def saved_at(self) -> float | None:
        """When the checkpoint was saved, as the callback or save() stamped it (None when not stamped)."""
        t = self.trainmedic.get("saved_at")
        return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else None


def location(checkpoint: str) -> tuple[str, str, str | None]:
    """(manifest path, folder its paths are relative to, the one name they must lie under or None) for a
    checkpoint folder or file. A folder is judged by lstat: a link is a file here, never followed."""
    checkpoint = os.path.normpath(checkpoint)
    if os.path.isdir(checkpoint) and not os.path.islink(checkpoint):
        return os.path.join(checkpoint, MANIFEST), checkpoint, None
    folder, name = os.path.split(checkpoint)
    return os.path.join(folder, beside(name)), folder, name


def beside(name: str) -> str:
    """The manifest's name for a checkpoint file `name`: step=40.ckpt -> step=40.trainmedic.json."""
    return os.path.splitext(name)[0] + SUFFIX


def _rel(path: Any, scope: str | None) -> str:
    if not isinstance(path, str) or not path or "\x00" in path or "\\" in path:
        raise ManifestError("a file's path is not a relative path")
    p = PurePosixPath(path)
    if p.is_absolute() or any(part in ("..", ".") for part in p.parts) or str(p) != path:
        raise ManifestError(f"the path {path!r} lies outside the checkpoint")
    if p.name == MANIFEST or p.name.endswith(SUFFIX):
        raise ManifestError("a manifest lists itself")
    if scope is not None and p.parts[0] != scope:
        raise ManifestError(f"the path {path!r} lies outside the checkpoint {scope}")
    return path


def _count(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ManifestError(f"{what} is not a whole number of at least 0")
    return value


def parse(data: bytes | str, scope: str | None = None) -> Manifest:
    """A manifest from its text; ManifestError (one sentence) when it is not one, names a path outside the
    checkpoint (`scope`: the one top-level name its paths must lie under), or lists a negative size."""
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise ManifestError("the manifest is not JSON") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("files"), list) or not raw["files"]:
        raise ManifestError("the manifest lists no files")
    extra = raw.get("trainmedic", {})
    if not isinstance(extra, dict):
        raise ManifestError("the manifest's trainmedic entry is not an object")
    files, seen = [], set()
    for item in raw["files"]:
        if not isinstance(item, dict):
            raise ManifestError("a file entry is not an object")
        digest = item.get("sha256")
        if not isinstance(digest, str) or not _HEX.match(digest):
            raise ManifestError("a file's sha256 is not 64 hexadecimal digits")
        entry = Entry(_rel(item.get("path"), scope), _count(item.get("size"), "a file's size"), digest)
        if entry.path in seen:
            raise ManifestError(f"the path {entry.path!r} is listed twice")
        seen.add(entry.path)
        files.append(entry)
    return Manifest(_count(raw.get("step"), "the step"), tuple(files), extra)


def read(checkpoint: str) -> Manifest | None:
    """The checkpoint's manifest; None when it has none; ManifestError when it does not parse."""
    path, _, scope = location(checkpoint)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ManifestError(f"the manifest cannot be read ({exc.strerror or exc})") from None
    if len(data) > MAX_BYTES:
        raise ManifestError("the manifest is too large to be one")
    return parse(data, scope)


def digest_of(f: io.BufferedIOBase) -> str:
    """The SHA-256 of an open file, read in chunks (hashlib releases the GIL on each)."""
    h, buf = hashlib.sha256(), bytearray(CHUNK)
    view = memoryview(buf)
    while n := f.readinto(buf):
        h.update(view[:n])
    return h.hexdigest()


def inside(path: str, folder: str) -> bool:
    """Whether a path, its links followed, is the folder or lies below it."""
    real, top = os.path.realpath(path), os.path.realpath(folder)
    return real == top or real.startswith(top.rstrip(os.sep) + os.sep)


def check(manifest: Manifest, folder: str, digests: bool = True) -> Why | None:
    """None when every listed file is present with its size (and, with `digests`, its SHA-256); else the
    first kind of fault found (missing, then size, then digest). A listed path whose links lead out of the
    folder counts as missing: it is never read."""
    paths = [os.path.join(folder, e.path) for e in manifest.files]
    sizes = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            return Why.MISSING_FILE
        if not inside(path, folder) or not os.path.isfile(path):
            return Why.MISSING_FILE
        sizes.append(st.st_size)
    if any(size != e.size for size, e in zip(sizes, manifest.files)):
        return Why.SIZE_MISMATCH
    if digests:
        for path, e in zip(paths, manifest.files):
            try:
                with open(path, "rb") as f:
                    if digest_of(f) != e.sha256:
                        return Why.DIGEST_MISMATCH
            except OSError:
                return Why.MISSING_FILE
    return None


def files_of(checkpoint: str) -> list[str]:
    """The files a checkpoint is made of, relative to its manifest's folder (sorted; the manifest and
    temporary files left out; links inside a folder are not followed)."""
    _, folder, scope = location(checkpoint)
    if scope is not None:
        return [scope]
    out = []
    for dirpath, dirs, files in os.walk(folder):
        dirs.sort()
        for name in files:
            if name == MANIFEST or name.startswith(".") or os.path.islink(os.path.join(dirpath, name)):
                continue
            out.append(os.path.relpath(os.path.join(dirpath, name), folder).replace(os.sep, "/"))
    return sorted(out)


class Changed(Exception):
    """A checkpoint's file changed while it was hashed: its manifest would not describe it."""


def describe(checkpoint: str, step: int, trainmedic: Mapping[str, Any]) -> Manifest:
    """The manifest of a checkpoint as it is on disk now, hashing each file; Changed when a file changed
    meanwhile, OSError when one went."""
    _, folder, _ = location(checkpoint)
    entries = []
    for rel in files_of(checkpoint):
        path = os.path.join(folder, rel)
        with open(path, "rb") as f:
            before = os.fstat(f.fileno())
            digest = digest_of(f)
            after = os.fstat(f.fileno())
        if (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns):
            raise Changed(path)
        entries.append(Entry(rel, after.st_size, digest))
    if not entries:
        raise FileNotFoundError(checkpoint)
    return Manifest(step, tuple(entries), trainmedic)


def still(manifest: Manifest, folder: str) -> bool:
    """Whether the files are still the sizes the manifest says (just before it is written)."""
    return check(manifest, folder, digests=False) is None


def write_atomically(path: str, fill: Callable[[Any], object]) -> None:
    """Write a file by fill(f) under a temporary name in its folder, fsync it, rename it into place, fsync the
    folder: a reader sees the old file or the whole new one, never a part."""
    folder, name = os.path.split(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    sync_folder(folder or ".")


def sync_folder(folder: str) -> None:
    """fsync a folder, so a rename in it survives a crash (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write(checkpoint: str, manifest: Manifest) -> str:
    """Write the checkpoint's manifest atomically; returns its path."""
    path, _, _ = location(checkpoint)
    data = manifest.to_json().encode()
    write_atomically(path, lambda f: f.write(data))
    return path


def write_if_still(checkpoint: str, step: int, trainmedic: Mapping[str, Any]) -> str:
    """Hash the checkpoint and write its manifest, unless a file changed or went meanwhile (Changed,
    OSError); returns the manifest's path."""
    m = describe(checkpoint, step, trainmedic)
    if not still(m, location(checkpoint)[1]):
        raise Changed(checkpoint)
    return write(checkpoint, m)


def main() -> int:
    """As a child process: {"checkpoint", "step", "trainmedic"} on stdin, at the lowest CPU priority; prints
    the manifest's path. Exit 0: written; 3: the checkpoint changed or went meanwhile; 1: could not write."""
    import signal
    import sys

    # In the training's session and process group, so that the lowest priority is lowest among its processes;
    # a Ctrl-C meant for the training then reaches this too: finish the manifest all the same.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        os.nice(19)  # only CPU time the training does not want; SCHED_IDLE: only time no one else wants
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # type: ignore[attr-defined,unused-ignore]
    except (AttributeError, OSError):
        pass
    job = json.load(sys.stdin)
    try:
        print(write_if_still(str(job["checkpoint"]), int(job["step"]), dict(job.get("trainmedic") or {})))
    except (FileNotFoundError, Changed):
        return 3
    except OSError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


def remove(checkpoint: str) -> None:
    """Remove a checkpoint's manifest before the checkpoint is written again (none: nothing to do)."""
    try:
        os.unlink(location(checkpoint)[0])
    except OSError:
        pass


if __name__ == "__main__":
    raise SystemExit(main())
