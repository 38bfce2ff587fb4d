"""Whether a file or directory may hold code this process is about to load: only this user's or
root's, and writable by nobody else.

Why: JIT caches (HybridEP's, DeepEP v2's) hold compiled kernels that a process dlopens; a cache
another user can write lets that user run code in every job that uses it. Standard library only.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import NamedTuple

#: How many entries of a cache ``untrusted_inside`` looks at before it stops (and says so): a
#: check that runs before every job must not walk a huge shared tree for minutes.
INSIDE_LIMIT = 10_000


def untrusted(path: Path, *, follow: bool = False) -> str | None:
    """Why ``path`` may hold code that is not this user's or root's, or None: it must be owned
    by this user or by root and be writable by nobody else."""
    return untrusted_stat(path, os.stat(path) if follow else os.lstat(path))


def untrusted_stat(path: Path, st: os.stat_result) -> str | None:
    """``untrusted`` of a file already looked at (``st``: its lstat, or fstat of it open)."""
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link"
    if st.st_uid not in (os.geteuid(), 0):
        return f"{path} belongs to uid {st.st_uid}, neither this user nor root"
    if st.st_mode & 0o022:
        return f"others can write {path} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def untrusted_cache(root: Path) -> str | None:
    """Why a cache directory (existing or about to be made) is not safe to load kernels from,
    or None: the directory itself, else the nearest ancestor that exists, must be trusted; the
    one holding it may be writable by others only when sticky (/tmp: nobody else can rename or
    replace what is ours there)."""
    path = root
    while not path.exists() and path != path.parent:
        path = path.parent
    if (why := untrusted(path, follow=True)) is not None:
        return why
    parent = path.parent
    if parent != path and parent.exists():
        st = os.stat(parent)
        why = untrusted(parent, follow=True)
        if why is not None and not (st.st_mode & stat.S_ISVTX and "others can write" in why):
            return why
    return None


class Inside(NamedTuple):
    """What ``untrusted_inside`` found: why the first offending entry is not safe (or None), how
    many entries it looked at, and whether that was all of them."""

    why: str | None
    entries: int
    complete: bool


def untrusted_inside(root: Path, limit: int = INSIDE_LIMIT) -> Inside:
    """The first directory or file inside the directory ``root`` (each directory in name order,
    depth first, no symbolic link followed into) that another user could have written or that
    belongs to neither this user nor root; a symbolic link counts by its owner and by what it
    points to. The walk stops after ``limit`` entries (``complete`` False). A directory this
    user cannot list is skipped: nothing in it is loaded by this user's process either."""
    seen = 0
    pending = [root]
    while pending:
        try:
            with os.scandir(pending.pop()) as listing:
                entries = sorted(listing, key=lambda e: e.name)
        except OSError:
            continue
        below = []
        for entry in entries:
            if seen >= limit:
                return Inside(None, seen, complete=False)
            seen += 1
            path = Path(entry.path)
            try:
                why = _untrusted_entry(path)
            except OSError:
                continue  # removed meanwhile
            if why is not None:
                return Inside(why, seen, complete=True)
            if entry.is_dir(follow_symlinks=False):
                below.append(path)
        pending += reversed(below)  # the first subdirectory is walked next
    return Inside(None, seen, complete=True)


def _untrusted_entry(path: Path) -> str | None:
    st = os.lstat(path)
    if not stat.S_ISLNK(st.st_mode):
        return untrusted(path)
    if st.st_uid not in (os.geteuid(), 0):
        return f"{path} belongs to uid {st.st_uid}, neither this user nor root"
    return untrusted(path, follow=True) if path.exists() else None
