"""disk_cleanup: delete old checkpoints below the operator's allow-roots only, never through a link."""
from __future__ import annotations

import fnmatch
import logging
import os
import re
import shutil
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from trainmedic.client.wire.actions import DiskCleanup

from trainmedic.client.receiver.outcome import ActionFailed

log = logging.getLogger("trainmedic.agent")

# A checkpoint touched this recently may still be being written: never delete it.
RECENT_SECONDS = 60.0
# Paths listed in a result (the record stays small); the counts are always complete.
LIST_CAP = 200
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


@dataclass(frozen=True)
class Candidate:
    """One entry matching a pattern: a checkpoint file or folder, by its place below a root."""

    root: str
    parts: tuple[str, ...]
    is_dir: bool
    size: int
    mtime: float  # newest modification of anything in it
    dev: int
    ino: int

    @property
    def path(self) -> str:
        return os.path.join(self.root, *self.parts)

    @property
    def run(self) -> tuple[str, tuple[str, ...]]:
        return self.root, self.parts[:-1]


@dataclass
class Report:
    """What one cleanup did (or, in a dry run, would do)."""

    roots: list[str]
    dry_run: bool
    deleted: list[str] = field(default_factory=list)
    bytes_freed: int = 0
    kept: int = 0
    left_alone: list[dict] = field(default_factory=list)
    links_ignored: list[str] = field(default_factory=list)
    over_cap: int = 0
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        out: dict = {"roots": self.roots, "dry_run": self.dry_run, "kept": self.kept,
                     "left_alone": self.left_alone[:LIST_CAP], "links_ignored": self.links_ignored[:LIST_CAP]}
        if self.dry_run:
            out.update(deleted=[], bytes_freed=0, would_delete=self.deleted[:LIST_CAP],
                       would_delete_count=len(self.deleted), bytes_would_free=self.bytes_freed)
        else:
            out.update(deleted=self.deleted[:LIST_CAP], deleted_count=len(self.deleted), bytes_freed=self.bytes_freed)
        if self.over_cap:
            out["over_cap"] = self.over_cap
        if self.errors:
            out["errors"] = self.errors[:LIST_CAP]
        return out


def check_roots(roots: Iterable[str | os.PathLike]) -> list[Path]:
    """The operator's allow-roots made absolute; raises ValueError for a root that would allow anything."""
    out = []
    for raw in roots:
        path = Path(os.path.abspath(os.fspath(raw)))
        if path == Path(path.anchor) or os.path.realpath(path) == os.path.abspath(os.sep):
            raise ValueError(f"--allow-root {raw} would let the agent delete anywhere on the host; name a folder")
        out.append(path)
    return out


def _resolved_roots(roots: Sequence[str | os.PathLike]) -> list[str]:
    if not roots:
        raise ActionFailed("The agent was started without --allow-root, so it may not delete anything.")
    resolved: list[str] = []
    for raw in roots:
        real = os.path.realpath(raw)
        if not os.path.isdir(real):
            raise ActionFailed(f"The allow-root {os.fspath(raw)} does not exist or is not a folder; "
                               "nothing was deleted.")
        resolved.append(real)
    # A root inside another root would be walked twice.
    unique = sorted(set(resolved))
    return [r for r in unique if not any(r != o and r.startswith(o.rstrip(os.sep) + os.sep) for o in unique)]


def _natural(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _measure(dir_fd: int, name: str, top: os.stat_result) -> tuple[int, float]:
    """Bytes of regular files in a folder and its newest mtime, never following links."""
    size, newest = 0, top.st_mtime
    for _, dirs, files, fd in os.fwalk(name, dir_fd=dir_fd, follow_symlinks=False):
        newest = max(newest, os.fstat(fd).st_mtime)
        for f in files + dirs:
            try:
                st = os.stat(f, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            newest = max(newest, st.st_mtime)
            if stat.S_ISREG(st.st_mode):
                size += st.st_size
    return size, newest


def _scan(root: str, patterns: Sequence[str], report: Report) -> list[Candidate]:
    out: list[Candidate] = []
    for dirpath, dirs, files, dir_fd in os.fwalk(root, follow_symlinks=False):
        rel = os.path.relpath(dirpath, root)
        base = () if rel == "." else tuple(rel.split(os.sep))
        for name in sorted(dirs + files):
            if not any(fnmatch.fnmatchcase(name, p) for p in patterns):
                continue
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if name in dirs:
                dirs.remove(name)  # a checkpoint folder is one entry: never descend into it
            if stat.S_ISLNK(st.st_mode):
                # Never followed and never deleted: its target may lie outside the root.
                report.links_ignored.append(os.path.join(dirpath, name))
            elif stat.S_ISDIR(st.st_mode):
                size, mtime = _measure(dir_fd, name, st)
                out.append(Candidate(root, base + (name,), True, size, mtime, st.st_dev, st.st_ino))
            elif stat.S_ISREG(st.st_mode):
                out.append(Candidate(root, base + (name,), False, st.st_size, st.st_mtime, st.st_dev, st.st_ino))
    return out


def _select(cands: list[Candidate], params: DiskCleanup, now: float, report: Report) -> list[Candidate]:
    """The candidates that may go: not among the newest keep_last of their run, old enough, not being written."""
    runs: dict[tuple[str, tuple[str, ...]], list[Candidate]] = {}
    for c in cands:
        runs.setdefault(c.run, []).append(c)
    doomed: list[Candidate] = []
    for members in runs.values():
        members.sort(key=lambda c: (c.mtime, _natural(c.parts[-1])), reverse=True)
        report.kept += min(len(members), params.keep_last)
        for c in members[params.keep_last:]:
            age = now - c.mtime
            if age < RECENT_SECONDS:
                report.left_alone.append({"path": c.path, "reason": "modified in the last minute"})
            elif age < params.older_than:
                report.kept += 1
            else:
                doomed.append(c)
    doomed.sort(key=lambda c: (c.mtime, c.path))  # oldest first, so a byte cap spares the newer ones
    return doomed


def _open_parent(c: Candidate) -> int:
    """A descriptor of the candidate's folder, opened from the root one component at a time, never via a link."""
    fd = os.open(c.root, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    try:
        for part in c.parts[:-1]:
            nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def _delete(c: Candidate, now: float) -> str | None:
    """Delete one candidate; None when done, else why it was left alone."""
    fd = _open_parent(c)
    try:
        name = c.parts[-1]
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if (st.st_dev, st.st_ino) != (c.dev, c.ino) or stat.S_ISLNK(st.st_mode):
            return "replaced since it was examined"
        if now - st.st_mtime < RECENT_SECONDS or time.time() - st.st_mtime < RECENT_SECONDS:
            return "modified in the last minute"
        if c.is_dir:
            shutil.rmtree(name, dir_fd=fd)  # fd-based: removes links inside, never their targets
        else:
            os.unlink(name, dir_fd=fd)
        return None
    finally:
        os.close(fd)


def cleanup(roots: Sequence[str | os.PathLike], params: DiskCleanup, dry_run: bool = False,
            now: float | None = None) -> dict:
    """Delete (or list, in a dry run) old checkpoints below the allow-roots; the result for the record."""
    now = time.time() if now is None else now
    resolved = _resolved_roots(roots)
    report = Report(roots=resolved, dry_run=dry_run)
    cands: list[Candidate] = []
    for root in resolved:
        try:
            cands.extend(_scan(root, params.patterns, report))
        except OSError as exc:
            raise ActionFailed(f"Could not read the allow-root {root}: {exc.strerror or exc}.") from None
    doomed = _select(cands, params, now, report)
    for i, c in enumerate(doomed):
        if params.max_bytes is not None and report.bytes_freed + c.size > params.max_bytes:
            # Oldest first until the cap: everything newer than the first that does not fit stays.
            report.over_cap = len(doomed) - i
            break
        if not dry_run:
            try:
                why = _delete(c, now)
            except OSError as exc:
                report.errors.append(f"{c.path}: {exc.strerror or exc}")
                continue
            if why:
                report.left_alone.append({"path": c.path, "reason": why})
                continue
            log.info("disk_cleanup deleted %s (%s bytes)", c.path, c.size)
        report.deleted.append(c.path)
        report.bytes_freed += c.size
    if report.errors and not report.deleted:
        raise ActionFailed(f"Nothing could be deleted: {report.errors[0]}.", **report.as_dict())
    return report.as_dict()
