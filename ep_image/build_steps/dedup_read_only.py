"""dedup ``--read-only``: shared inodes lose their write bits; a killed run is undone by the next.

Why a module of its own: an in-place write into a file two venvs share reaches both, so under
``--read-only`` every shared inode is made read-only. The modes are cleared before hardlink
compares (so copies still match) and given back to files that stayed unshared; each ROOT's
journal ``.dedup-read-only-modes.json`` lists them first, so that the next run gives back what a
killed one cleared. docs/host-mode.md, "Hardlinked venvs and installers".
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from ep_image import cli
from ep_image.build_steps import dedup_tree
from ep_image.build_steps.dedup_report import Report
from ep_image.build_steps.dedup_tree import MODES_JOURNAL, WRITE_BITS, DedupError, Tree

#: The --exclude regexes of the copies also linked from outside may not pass this: a command
#: line holds about 2 MiB in all.
EXCLUDE_REGEX_LIMIT = 1 << 20
_HEAD = 4096


def _chmod(path: str, mode: int, report: Report) -> bool:
    try:
        os.chmod(path, mode, follow_symlinks=False)
    except FileNotFoundError:
        return False  # gone meanwhile: the walk after the run counts it as vanished
    except OSError as exc:
        report.failures.append(f"{path}: cannot change its mode: {exc}")
        return False
    return True


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
        if _chmod(tree.files[key].path, mode & ~WRITE_BITS, report)
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
        temp = root / (MODES_JOURNAL + ".tmp")
        try:
            temp.unlink(missing_ok=True)
            # Owner-only and new (O_EXCL): a journal is trusted only when nobody else could
            # have written it (restore_journals).
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with open(fd, "w", encoding="utf-8") as handle:
                json.dump(record, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temp, journal)
        except OSError as exc:
            temp.unlink(missing_ok=True)
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


def _read_journal(journal: Path) -> tuple[str | None, str]:
    """Why a journal may not be acted on (or None), and its text.

    It is opened once, without following a symbolic link, and checked and read through that one
    descriptor: a journal swapped for a link between a check by path and a read by path would
    get another file's entries read.
    """
    try:
        fd = os.open(journal, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symbolic link
            return "it is a symbolic link", ""
        raise
    with open(fd, encoding="utf-8") as handle:
        why = _untrusted(os.fstat(fd))
        return why, "" if why else handle.read()


def _untrusted(st: os.stat_result) -> str | None:
    """Why an open journal may not be acted on, or None: it must be a regular file of the user
    running dedup that nobody else can write (dedup writes it so), since giving back write
    bits as it says, run as root, would otherwise let anyone who can write a ROOT make any
    file on the system writable."""
    if not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    if st.st_uid != os.geteuid():
        return f"it belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return f"others can write it (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _entry_path(root: Path, relative: object, dev: object) -> str | None:
    """The path a journal entry names, if it is one dedup could have written: relative, in
    normal form, inside ``root`` through no symbolic link, on ``root``'s file system."""
    if not isinstance(relative, str) or not isinstance(dev, int):
        return None
    parts = Path(relative).parts
    if (
        not parts
        or os.path.isabs(relative)
        or ".." in parts
        or os.path.normpath(relative) != relative
    ):
        return None
    parent = os.path.join(root, *parts[:-1])
    real_root = os.path.realpath(root)
    if os.path.realpath(parent) != os.path.join(real_root, *parts[:-1]).rstrip("/"):
        return None  # a symbolic link on the way: it may lead out of the ROOT
    if os.lstat(root).st_dev != dev:
        return None
    return os.path.join(root, relative)


def restore_journals(roots: Sequence[Path], report: Report, *, dry_run: bool) -> None:
    """Give back the modes a killed --read-only run cleared (its journals), then drop them.

    A journal is acted on only when this user wrote it and nobody else can (``_read_journal``),
    and a mode is given back only where its entry names a file under that ROOT (no ``..``, no
    symbolic link on the way) that is still the inode the journal names and still has the mode
    the run left (its write bits cleared, nothing else changed since).
    """
    for root in roots:
        journal = root / MODES_JOURNAL
        if not dry_run:  # a run killed while writing its journal had cleared nothing yet
            (root / (MODES_JOURNAL + ".tmp")).unlink(missing_ok=True)
        try:
            why, text = _read_journal(journal)
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
                path = _entry_path(root, relative, dev)
                if path is None or not isinstance(mode, int) or mode & ~0o7777:
                    refused += 1
                    continue
                st = os.lstat(path)
            except (OSError, TypeError, ValueError):
                continue
            same = (st.st_dev, st.st_ino) == (dev, ino) and stat.S_ISREG(st.st_mode)
            as_left = stat.S_IMODE(st.st_mode) == mode & ~WRITE_BITS != mode
            if same and as_left and (dry_run or _chmod(path, mode, report)):
                report.modes_restored += 1
        if refused:
            report.failures.append(
                f"{journal}: {refused} entries name no file dedup could have recorded (outside "
                "the ROOT, through a symbolic link, or on another file system): left alone"
            )
        if not dry_run:
            journal.unlink(missing_ok=True)


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
    regexes = dedup_tree.paths_regexes(apart)
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
                _chmod(inode.path, changed[key], report)
        elif inode.linked_outside:
            continue
        elif inode.mode & WRITE_BITS:
            if _chmod(inode.path, inode.mode & ~WRITE_BITS, report):
                report.files_made_read_only += inode.here
        elif key in changed:
            report.files_made_read_only += inode.here
