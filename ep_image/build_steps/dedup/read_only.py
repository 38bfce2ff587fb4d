"""dedup ``--read-only``: shared inodes lose their write bits; a killed run is undone by the next.

Why a module of its own: an in-place write into a file two venvs share reaches both, so under
``--read-only`` every shared inode is made read-only. The modes are cleared before hardlink
compares (so copies still match) and given back to files that stayed unshared; each ROOT's
journal ``.dedup-read-only-modes.json`` lists them first, so that the next run gives back what a
killed one cleared. docs/host-mode.md, "Hardlinked venvs and installers".
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from ep_image import cli
from ep_image.build_steps.dedup.report import Report
from ep_image.build_steps.dedup.tree import (
    MODES_JOURNAL,
    WRITE_BITS,
    DedupError,
    Tree,
    paths_regexes,
    read_own_journal,
    write_own_journal,
)

#: The --exclude regexes of the copies also linked from outside may not pass this: a command
#: line holds about 2 MiB in all.
EXCLUDE_REGEX_LIMIT = 1 << 20
_HEAD = 4096


def _chmod(
    path: str,
    mode: int,
    report: Report,
    wanted: Callable[[os.stat_result], bool] = lambda st: True,
    *,
    fd: int | None = None,
) -> bool:
    """Give the regular file at ``path`` (or the one ``fd`` holds) ``mode``, if ``wanted`` says
    so of it; True when done. The file is opened once without following a symbolic link, and
    checked and changed through that descriptor: a path swapped for a link (or anything else)
    after dedup looked at it is left alone, never followed."""
    own = fd is None
    if fd is None:
        try:
            fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return False  # gone meanwhile: the walk after the run counts it as vanished
        except OSError as exc:
            report.failures.append(f"{path}: cannot change its mode: {exc}")
            return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not wanted(st):
            return False  # replaced meanwhile: not the file dedup looked at
        os.chmod(f"/proc/self/fd/{fd}", mode)  # the inode the descriptor holds, not a path
    except OSError as exc:
        report.failures.append(f"{path}: cannot change its mode: {exc}")
        return False
    finally:
        if own:
            os.close(fd)
    return True


def _is(key: tuple[int, int]) -> Callable[[os.stat_result], bool]:
    """Whether a file is the inode ``key`` (device, inode) the walk booked."""
    return lambda st: (st.st_dev, st.st_ino) == key


def to_clear(tree: Tree) -> dict[tuple[int, int], int]:
    """The inodes whose write bits are cleared before hardlink runs, with their modes. Inodes
    also linked from outside the ROOTs are not ours to change."""
    return {
        key: inode.mode
        for key, inode in tree.files.items()
        if inode.candidate and not inode.linked_outside and inode.mode & WRITE_BITS
    }


def clear_write_bits(
    tree: Tree, clear: dict[tuple[int, int], int], report: Report
) -> dict[tuple[int, int], int]:
    """Clear the write bits of ``clear`` (after its journals are written); return the inodes
    whose mode did change, with the mode each had."""
    return {
        key: mode
        for key, mode in clear.items()
        if _chmod(tree.files[key].path, mode & ~WRITE_BITS, report, _is(key))
    }


# --------------------------------------------------------------------------- the journal


def _root_of(path: str, roots: Sequence[Path]) -> Path:
    return next(r for r in roots if path.startswith(str(r) + "/"))


def write_journals(tree: Tree, clear: dict[tuple[int, int], int], roots: Sequence[Path]) -> None:
    """Before any mode changes: each ROOT's journal of the modes about to be cleared, on disk
    (fsync, then rename into place), so that a killed run can be undone by the next."""
    entries: dict[Path, list[list[object]]] = {root: [] for root in roots}
    for key, mode in clear.items():
        path = tree.files[key].path
        root = _root_of(path, roots)
        entries[root].append([os.path.relpath(path, root), key[0], key[1], mode])
    for root, modes in entries.items():
        if not modes:
            continue
        record = {
            "written_by": "python3 -m ep_image.build_steps.dedup --read-only",
            "meaning": "the modes of these files before their write bits were cleared; a "
            "run of python3 -m ep_image.build_steps.dedup on this ROOT gives them back and "
            "removes this file",
            "modes": modes,
        }
        journal = root / MODES_JOURNAL
        try:
            # Owner-only and new: a journal is trusted only when nobody else could have written
            # it (restore_journals).
            write_own_journal(journal, record)
        except OSError as exc:
            raise DedupError(
                f"cannot write {journal}, where --read-only records the modes it clears so "
                f"that a killed run can be undone ({exc}). Nothing was changed.",
                cli.os_error_fix(
                    exc,
                    root,
                    "run dedup as the owner of the trees (it needs to write into each ROOT), or "
                    "without --read-only",
                ),
            ) from None


def _open_entry(root: Path, relative: object, dev: object) -> int | None:
    """An O_PATH descriptor of the file a journal entry names, if it is one dedup could have
    written: relative, in normal form, on ``root``'s file system, and reached from ``root``
    one component at a time through no symbolic link (so it cannot lead out of the ROOT, even
    if a directory on the way is swapped meanwhile). None otherwise, or when it is gone."""
    if not isinstance(relative, str) or not isinstance(dev, int):
        return None
    parts = Path(relative).parts
    if (
        not parts
        or os.path.isabs(relative)
        or ".." in parts
        or os.path.normpath(relative) != relative
        or os.lstat(root).st_dev != dev
    ):
        return None
    flags = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(root, flags | os.O_DIRECTORY)
    try:
        for part in parts[:-1]:
            below = os.open(part, flags | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = below
        found = os.open(parts[-1], flags, dir_fd=fd)
    except OSError:
        return None  # a symbolic link on the way (ELOOP, ENOTDIR) or gone
    finally:
        os.close(fd)
    return found


def restore_journals(roots: Sequence[Path], report: Report, *, dry_run: bool) -> None:
    """Give back the modes a killed --read-only run cleared (its journals), then drop them.

    A journal is acted on only when this user wrote it and nobody else can
    (``read_own_journal``), and a mode is given back only where its entry names a
    file under that ROOT (no ``..``, no symbolic link on the way) that is still the inode the
    journal names and still has the mode the run left (its write bits cleared, nothing else
    changed since), checked and changed through one descriptor of it.
    """
    for root in roots:
        journal = root / MODES_JOURNAL
        if not dry_run:  # a run killed while writing its journal had cleared nothing yet
            (root / (MODES_JOURNAL + ".tmp")).unlink(missing_ok=True)
        try:
            why, text = read_own_journal(journal)
            if why is not None:
                report.failures.append(
                    f"{journal}: refused, {why}: dedup writes its journal owner-only, so this "
                    "one may have been planted; nothing it lists was changed. Fix: remove it if "
                    "you did not write it, or run dedup as its owner"
                )
                continue
            modes = json.loads(text)["modes"]
        except FileNotFoundError:
            continue
        except (OSError, ValueError, KeyError, TypeError) as exc:
            report.failures.append(
                f"{journal}: cannot read this journal of a killed --read-only run ({exc}); "
                "files it lists may stay read-only: check their modes, then remove it"
            )
            continue
        refused = 0
        for entry in modes:
            try:
                relative, dev, ino, mode = entry
                if not isinstance(mode, int) or mode & ~0o7777:
                    refused += 1
                    continue
                fd = _open_entry(root, relative, dev)
            except (OSError, TypeError, ValueError):
                continue
            if fd is None:
                refused += _named_outside(root, relative)
                continue
            as_left = _left_by_a_run(dev, ino, mode)
            try:
                if dry_run:
                    st = os.fstat(fd)
                    done = stat.S_ISREG(st.st_mode) and as_left(st)
                else:
                    done = _chmod(os.path.join(root, str(relative)), mode, report, as_left, fd=fd)
            finally:
                os.close(fd)
            report.modes_restored += done
        if refused:
            report.failures.append(
                f"{journal}: {refused} entries name no file dedup could have recorded (outside "
                "the ROOT, through a symbolic link, or on another file system): left alone"
            )
        if not dry_run:
            journal.unlink(missing_ok=True)


def _left_by_a_run(dev: object, ino: object, mode: int) -> Callable[[os.stat_result], bool]:
    """Whether a file is still the inode a journal entry names, with the mode the run left:
    write bits cleared, nothing else changed since."""

    def as_left(st: os.stat_result) -> bool:
        same = (st.st_dev, st.st_ino) == (dev, ino)
        return same and stat.S_IMODE(st.st_mode) == mode & ~WRITE_BITS != mode

    return as_left


def _named_outside(root: Path, relative: object) -> int:
    """1 when an entry names a path dedup could not have recorded (not merely a file that is
    gone since): ``..``, absolute, not in normal form, or through a symbolic link."""
    if not isinstance(relative, str):
        return 1
    parts = Path(relative).parts
    if not parts or os.path.isabs(relative) or ".." in parts:
        return 1
    if os.path.normpath(relative) != relative:
        return 1
    path = root
    for part in parts:
        path = path / part
        if path.is_symlink():
            return 1
        if not os.path.lexists(path):
            return 0
    return 0


def drop_journals(roots: Sequence[Path]) -> None:
    """The run is done: its journals have nothing left to undo."""
    for root in roots:
        (root / MODES_JOURNAL).unlink(missing_ok=True)
        (root / (MODES_JOURNAL + ".tmp")).unlink(missing_ok=True)


# --------------------------------------------------------------------------- linked from outside


def keep_apart(tree: Tree, clear: dict[tuple[int, int], int]) -> list[str]:
    """The paths of inodes also linked from outside the ROOTs that have a copy here hardlink
    could link them with; dedup passes them to hardlink as excludes.

    Such an inode cannot be made read-only (it is not ours), so under --read-only nothing may
    be linked into it or it into anything. A copy is an inode of equal size, owner, group and
    mode as hardlink will see it (write bits cleared where they will be) whose first 4 KiB
    are equal too; hardlink compares the rest, so an unequal one is merely kept apart as well.
    """
    groups: dict[tuple[int, int, int, int], list[tuple[int, int]]] = {}
    for key, inode in tree.files.items():
        if inode.candidate:
            mode = inode.mode & ~WRITE_BITS if key in clear else inode.mode
            groups.setdefault((inode.size, inode.uid, inode.gid, mode), []).append(key)
    apart: set[tuple[int, int]] = set()
    for keys in groups.values():
        if len(keys) < 2 or not any(tree.files[k].linked_outside for k in keys):
            continue
        heads = {k: _head(tree.files[k].path) for k in keys}
        counts = Counter(heads.values())
        apart.update(k for k in keys if tree.files[k].linked_outside and counts[heads[k]] > 1)
    return [path for path, key in tree.index.items() if key in apart]


def apart_excludes(apart: list[str]) -> list[str]:
    """hardlink's --exclude regexes for ``apart``; DedupError when they would not fit on a
    command line."""
    regexes = paths_regexes(apart)
    if sum(map(len, regexes)) > EXCLUDE_REGEX_LIMIT:
        raise DedupError(
            f"{len(apart)} files here are also linked from outside the ROOTs and have copies "
            "here; --read-only cannot make them read-only and cannot keep that many apart "
            "(hardlink takes them as --exclude arguments). Nothing was changed.",
            "rebuild the venvs with UV_LINK_MODE=copy (as build_host.sh does), or run without "
            "--read-only",
        )
    return regexes


def _head(path: str) -> str:
    """A digest of the first 4 KiB (the path itself where it cannot be read: never equal)."""
    try:
        with open(path, "rb") as handle:
            return hashlib.sha256(handle.read(_HEAD)).hexdigest()
    except OSError:
        return "unreadable:" + path


# --------------------------------------------------------------------------- after linking


def settle_modes(tree: Tree, changed: dict[tuple[int, int], int], report: Report) -> None:
    """After linking: shared inodes stay read-only, unshared ones get theirs back; inodes also
    linked from outside keep theirs (reported as left writable)."""
    for key, inode in tree.files.items():
        if inode.candidate and inode.linked_outside:
            reason = "also linked from outside the ROOTs (e.g. uv's cache): not ours to change"
            report.left_writable[reason] = report.left_writable.get(reason, 0) + inode.here
        if inode.here < 2 or not inode.candidate:
            if key in changed:
                _chmod(inode.path, changed[key], report, _is(key))
        elif inode.linked_outside:
            continue
        elif inode.mode & WRITE_BITS:
            if _chmod(inode.path, inode.mode & ~WRITE_BITS, report, _is(key)):
                report.files_made_read_only += inode.here
        elif key in changed:
            report.files_made_read_only += inode.here
