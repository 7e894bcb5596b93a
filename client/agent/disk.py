"""disk_cleanup: delete old checkpoints below the operator's allow-roots only, never through a link.

The allow-roots are checked and opened once, when the agent starts (pinned by handle): a root that is a link,
or that sits below a folder other users may write, is refused, and later swaps of any path above a root
change nothing. Below a root, nothing is followed through a link, and no path with a component matching a
`protect` pattern (best*, *final*, *.json, ... and the playbook's own) is ever deleted.

The newest checkpoint of each run folder whose manifest's files are all present with their sizes (no hashing
here) stays, whatever `keep_last` says: a run whose newer checkpoints were cut short keeps one it can resume from.

The result says what happened on disk: `deleted` lists only paths that are gone, `pruned` the checkpoint
folders that stay because they hold protected entries (with what stayed), and `bytes_freed` counts only the data
whose last link went: a file whose data keeps another hard link (in or outside the roots) frees nothing.
"""
from __future__ import annotations

import fnmatch
import logging
import os
import re
import stat
import time
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Iterable, Sequence

from .. import manifest
from ..receiver.applier import ActionFailed
from ..wire.actions import DiskCleanup

log = logging.getLogger("trainmedic.agent")

# A checkpoint touched this recently may still be being written: never delete it.
RECENT_SECONDS = 60.0
# Paths listed in a result (the record stays small); the counts are always complete.
LIST_CAP = 200
# Why the newest whole checkpoint of a run stays (in the result's left_alone).
WHOLE = "the newest whole checkpoint of its run (its manifest's files are all present with their sizes)"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


@dataclass(frozen=True)
class AllowRoot:
    """An allow-root, opened once at start: every walk and delete below it goes through this handle."""

    path: str
    fd: int


@dataclass(frozen=True)
class FileLink:
    """One link to a regular file that a deletion would remove, as the scan found it."""

    dev: int
    ino: int
    nlink: int
    size: int


@dataclass(frozen=True)
class Candidate:
    """One entry matching a pattern: a checkpoint file or folder, by its place below a root."""

    root: str
    root_fd: int
    parts: tuple[str, ...]
    is_dir: bool
    files: tuple[FileLink, ...]  # the regular files its deletion would unlink
    mtime: float  # newest modification of anything in it
    dev: int
    ino: int
    keeps: tuple[str, ...] = ()  # protected entries inside a folder, relative to it: they stay

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
    pruned: list[dict[str, Any]] = field(default_factory=list)
    bytes_freed: int = 0
    kept: int = 0
    left_alone: list[dict[str, Any]] = field(default_factory=list)
    links_ignored: list[str] = field(default_factory=list)
    over_cap: int = 0
    errors: list[str] = field(default_factory=list)
    protected: list[str] = field(default_factory=list)
    removed: int = 0  # entries unlinked, so a failure can tell whether anything changed at all

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"roots": self.roots, "dry_run": self.dry_run, "kept": self.kept,
                     "left_alone": self.left_alone[:LIST_CAP], "links_ignored": self.links_ignored[:LIST_CAP],
                     "protected": self.protected[:LIST_CAP]}
        if self.dry_run:
            out.update(deleted=[], pruned=[], bytes_freed=0, would_delete=self.deleted[:LIST_CAP],
                       would_delete_count=len(self.deleted), would_prune=self.pruned[:LIST_CAP],
                       would_prune_count=len(self.pruned), bytes_would_free=self.bytes_freed)
        else:
            out.update(deleted=self.deleted[:LIST_CAP], deleted_count=len(self.deleted),
                       pruned=self.pruned[:LIST_CAP], pruned_count=len(self.pruned), bytes_freed=self.bytes_freed)
        if self.over_cap:
            out["over_cap"] = self.over_cap
        if self.errors:
            out["errors"] = self.errors[:LIST_CAP]
        return out


def _refuse_unsafe_parents(real: str, raw: str) -> None:
    """ValueError when a folder above the root can be written by others, so the root could be swapped."""
    me = os.geteuid()
    parts = real.strip(os.sep).split(os.sep)
    for depth in range(len(parts)):
        parent = os.sep + os.sep.join(parts[:depth])
        st = os.stat(parent)
        if st.st_mode & stat.S_IWOTH:
            child = os.lstat(os.path.join(parent, parts[depth]))
            # A sticky folder (/tmp) lets others add entries but not rename or remove ours.
            if not st.st_mode & stat.S_ISVTX or child.st_uid not in (0, me):
                raise ValueError(f"--allow-root {raw}: {parent} is writable by other users, who could swap the "
                                 "folder for a link; choose a root whose parents only root (or this user) can write")


def pin_roots(roots: Iterable[str | os.PathLike[str]]) -> list[AllowRoot]:
    """The operator's allow-roots, checked and opened once; ValueError (one sentence) for an unsafe one."""
    pinned: dict[str, AllowRoot] = {}
    for raw in roots:
        text = os.fspath(raw)
        path = os.path.abspath(text)
        if os.path.islink(path):
            raise ValueError(f"--allow-root {text} is a link; name the folder itself")
        real = os.path.realpath(path)
        if real == os.path.abspath(os.sep) or path == os.path.abspath(os.sep):
            raise ValueError(f"--allow-root {text} would let the agent delete anywhere on the host; name a folder")
        if not os.path.isdir(real):
            raise ValueError(f"--allow-root {text} does not exist or is not a folder")
        _refuse_unsafe_parents(real, text)
        fd = os.open(real, _DIR_FLAGS)
        pinned[real] = AllowRoot(real, fd)
    # A root inside another root would be walked twice.
    unique = sorted(pinned)
    return [pinned[r] for r in unique if not any(r != o and r.startswith(o.rstrip(os.sep) + os.sep) for o in unique)]


def _live(roots: Sequence[AllowRoot]) -> list[AllowRoot]:
    if not roots:
        raise ActionFailed("The agent was started without --allow-root, so it may not delete anything.")
    for root in roots:
        if os.fstat(root.fd).st_nlink == 0:
            raise ActionFailed(f"The allow-root {root.path} was removed after the agent started; nothing was "
                               "deleted.")
    return list(roots)


def _natural(name: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _measure(dir_fd: int, name: str, top: os.stat_result,
             protect: Sequence[str]) -> tuple[tuple[FileLink, ...], float, tuple[str, ...]]:
    """The regular files a prune of this folder would unlink, its newest mtime, and the protected entries that
    would stay (relative to it). Links are never followed; nothing below a protected entry is counted."""
    links: list[FileLink] = []
    keeps: list[str] = []
    newest = top.st_mtime
    for dirpath, dirs, files, fd in os.fwalk(name, dir_fd=dir_fd, follow_symlinks=False):
        rel = os.path.relpath(dirpath, name)
        newest = max(newest, os.fstat(fd).st_mtime)
        keeps += [os.path.normpath(os.path.join(rel, d)) for d in dirs if _matches(d, protect)]
        dirs[:] = [d for d in dirs if not _matches(d, protect)]
        for f in files + dirs:
            try:
                st = os.stat(f, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            newest = max(newest, st.st_mtime)
            if f in dirs:
                continue
            if _matches(f, protect):
                keeps.append(os.path.normpath(os.path.join(rel, f)))
            elif stat.S_ISREG(st.st_mode):
                links.append(FileLink(st.st_dev, st.st_ino, st.st_nlink, st.st_size))
    return tuple(links), newest, tuple(sorted(keeps))


def _unlink(dir_fd: int, name: str, st: os.stat_result, report: Report) -> None:
    """Remove one non-folder entry; its bytes count as freed only when this was its data's last link."""
    os.unlink(name, dir_fd=dir_fd)
    report.removed += 1
    if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
        report.bytes_freed += st.st_size


def _prune(dir_fd: int, name: str, protect: Sequence[str], rel: str, report: Report) -> list[str]:
    """Delete a folder's contents except protected entries; remove the folder when nothing is left.
    Returns the protected entries kept (as paths from `rel`). Links inside are removed as links, never followed."""
    kept: list[str] = []
    fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    try:
        for entry in sorted(os.listdir(fd)):
            if _matches(entry, protect):
                kept.append(os.path.join(rel, entry))
                continue
            # Examined just before it goes: a hard link removed a moment ago leaves this one the last.
            st = os.stat(entry, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                kept += _prune(fd, entry, protect, os.path.join(rel, entry), report)
            else:
                _unlink(fd, entry, st, report)
    finally:
        os.close(fd)
    if not kept:
        os.rmdir(name, dir_fd=dir_fd)
        report.removed += 1
    return kept


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _scan(root: AllowRoot, patterns: Sequence[str], protect: Sequence[str], report: Report) -> list[Candidate]:
    out: list[Candidate] = []
    for dirpath, dirs, files, dir_fd in os.fwalk(".", dir_fd=root.fd, follow_symlinks=False):
        rel = os.path.normpath(dirpath)
        base = () if rel == "." else tuple(rel.split(os.sep))
        for name in sorted(dirs + files):
            if _matches(name, protect):
                # Protected, and so is everything below it: never a candidate, never walked into.
                is_dir = name in dirs
                if is_dir:
                    dirs.remove(name)
                if is_dir or _matches(name, patterns):
                    report.protected.append(os.path.join(root.path, *base, name))
                continue
            if not _matches(name, patterns):
                continue
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if name in dirs:
                dirs.remove(name)  # a checkpoint folder is one entry: never descend into it
            if stat.S_ISLNK(st.st_mode):
                # Never followed and never deleted: its target may lie outside the root.
                report.links_ignored.append(os.path.join(root.path, *base, name))
            elif stat.S_ISDIR(st.st_mode):
                links, mtime, keeps = _measure(dir_fd, name, st, protect)
                out.append(Candidate(root.path, root.fd, base + (name,), True, links, mtime, st.st_dev, st.st_ino,
                                     keeps))
            elif stat.S_ISREG(st.st_mode):
                link = FileLink(st.st_dev, st.st_ino, st.st_nlink, st.st_size)
                out.append(Candidate(root.path, root.fd, base + (name,), False, (link,), st.st_mtime, st.st_dev,
                                     st.st_ino))
    return out


def _size_at(dir_fd: int, rel: str) -> int | None:
    """The size of the regular file at `rel` below a folder, reached without following any link."""
    *folders, name = rel.split("/")
    fd = os.dup(dir_fd)
    try:
        for part in folders:
            nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nxt
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        return st.st_size if stat.S_ISREG(st.st_mode) else None
    finally:
        os.close(fd)


def _whole(c: Candidate) -> bool:
    """Whether the candidate's manifest (inside a folder, beside a file) lists files all present with their
    sizes; a manifest that does not parse, or a link on the way, says no."""
    try:
        parent = _open_parent(c)
    except OSError:
        return False
    try:
        name = c.parts[-1]
        base = os.open(name, _DIR_FLAGS, dir_fd=parent) if c.is_dir else os.dup(parent)
        try:
            with os.fdopen(os.open(manifest.MANIFEST if c.is_dir else manifest.beside(name), _FILE_FLAGS,
                                   dir_fd=base), "rb") as f:
                m = manifest.parse(f.read(manifest.MAX_BYTES), None if c.is_dir else name)
            return all(_size_at(base, e.path) == e.size for e in m.files)
        finally:
            os.close(base)
    except (OSError, manifest.ManifestError):
        return False
    finally:
        os.close(parent)


def _select(cands: list[Candidate], params: DiskCleanup, now: float, report: Report) -> list[Candidate]:
    """The candidates that may go: not among the newest keep_last of their run, old enough, not being written,
    and not the run's newest whole checkpoint."""
    runs: dict[tuple[str, tuple[str, ...]], list[Candidate]] = {}
    for c in cands:
        runs.setdefault(c.run, []).append(c)
    doomed: list[Candidate] = []
    for members in runs.values():
        members.sort(key=lambda c: (c.mtime, _natural(c.parts[-1])), reverse=True)
        report.kept += min(len(members), params.keep_last)
        # The run's newest whole checkpoint: manifests are read only once a checkpoint would go.
        newest_whole: Candidate | None = None
        looked = False
        for c in members[params.keep_last:]:
            age = now - c.mtime
            if age < RECENT_SECONDS:
                report.left_alone.append({"path": c.path, "reason": "modified in the last minute"})
                continue
            if age < params.older_than:
                report.kept += 1
                continue
            if not looked:
                newest_whole, looked = next((m for m in members if _whole(m)), None), True
            if c is newest_whole:
                report.kept += 1
                report.left_alone.append({"path": c.path, "reason": WHOLE})
            else:
                doomed.append(c)
    doomed.sort(key=lambda c: (c.mtime, c.path))  # oldest first, so a byte cap spares the newer ones
    return doomed


def _open_parent(c: Candidate) -> int:
    """A descriptor of the candidate's folder, opened from the root one component at a time, never via a link."""
    fd = os.dup(c.root_fd)
    try:
        for part in c.parts[:-1]:
            nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


class _LeftAlone(Exception):
    """A candidate that is no longer safe to delete; the message says why."""


def _delete(c: Candidate, now: float, protect: Sequence[str], report: Report) -> list[str]:
    """Delete one candidate, except what is protected inside a folder: the entries kept (relative to it; none
    when it is gone). Raises _LeftAlone when it changed since the scan."""
    fd = _open_parent(c)
    try:
        name = c.parts[-1]
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if (st.st_dev, st.st_ino) != (c.dev, c.ino) or stat.S_ISLNK(st.st_mode):
            raise _LeftAlone("replaced since it was examined")
        if now - st.st_mtime < RECENT_SECONDS or time.time() - st.st_mtime < RECENT_SECONDS:
            raise _LeftAlone("modified in the last minute")
        if c.is_dir:
            # A checkpoint folder goes, except what is protected inside it (a Hugging Face checkpoint's
            # config.json and trainer_state.json stay; its weights and optimizer state are freed).
            return _prune(fd, name, protect, "", report)
        _unlink(fd, name, st, report)
        return []
    finally:
        os.close(fd)


def _would_free(c: Candidate, links_left: dict[tuple[int, int], int]) -> int:
    """Bytes deleting this candidate would free after the ones before it: a file's size once its last link goes."""
    freed = 0
    for f in c.files:
        left = links_left.get((f.dev, f.ino), f.nlink) - 1
        links_left[(f.dev, f.ino)] = left
        if left <= 0:
            freed += f.size
    return freed


def cleanup(roots: Sequence[AllowRoot], params: DiskCleanup, dry_run: bool = False,
            now: float | None = None) -> dict[str, Any]:
    """Delete (or list, in a dry run) old checkpoints below the allow-roots; the result for the record."""
    now = time.time() if now is None else now
    live = _live(roots)
    report = Report(roots=[r.path for r in live], dry_run=dry_run)
    cands: list[Candidate] = []
    for root in live:
        try:
            cands.extend(_scan(root, params.patterns, params.protected, report))
        except OSError as exc:
            raise ActionFailed(f"Could not read the allow-root {root.path}: {exc.strerror or exc}.") from None
    doomed = _select(cands, params, now, report)
    # Links each file has left as the candidates before it go: hard links shared between candidates free
    # their data with the last one (a link from outside the roots never goes, so that data is never counted).
    links_left: dict[tuple[int, int], int] = {}
    for i, c in enumerate(doomed):
        expected = _would_free(c, links_left)
        if params.max_bytes is not None and report.bytes_freed + expected > params.max_bytes:
            # Oldest first until the cap: everything newer than the first that does not fit stays.
            report.over_cap = len(doomed) - i
            break
        if dry_run:
            kept = list(c.keeps)
            report.bytes_freed += expected
        else:
            before = report.bytes_freed
            try:
                kept = _delete(c, now, params.protected, report)
            except _LeftAlone as why:
                report.left_alone.append({"path": c.path, "reason": str(why)})
                continue
            except OSError as exc:
                report.errors.append(f"{c.path}: {exc.strerror or exc}")
                continue
            log.info("disk_cleanup %s %s (%s bytes freed)", "pruned" if kept else "deleted", c.path,
                     report.bytes_freed - before)
        if kept:
            kept.sort()
            report.pruned.append({"path": c.path, "kept": kept[:LIST_CAP]})
            report.protected += [os.path.join(c.path, k) for k in kept]
        else:
            report.deleted.append(c.path)
    if report.errors and not report.removed:
        raise ActionFailed(f"Nothing could be deleted: {report.errors[0]}.", **report.as_dict())
    return report.as_dict()
