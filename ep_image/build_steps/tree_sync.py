"""Make one directory tree equal to another, writing only the entries that differ.

The multi-backend image puts each finished venv onto its skeleton with it, so that layer holds
only the backend's own files: rsync's ``-a --delete``, which a minimal base image lacks. Regular
files count as equal with the same size, mode and owner, and with the same mtime or the same
bytes (the mtime is rsync's quick check, which reads no bytes). See docs/image.md, section
"Stages"; ``--help`` and tests/test_tree_sync.py hold the rest.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import filecmp
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ep_image import cli
from ep_image.files import mounts

#: At most this many problems of the source are listed (then how many more).
_LISTED = 20


class SyncError(RuntimeError):
    """The trees cannot be made equal; the message says why, its last line the fix."""


@dataclass
class SyncReport:
    """What one sync changed in the target."""

    files_written: int = 0
    bytes_written: int = 0
    links_made: int = 0
    symlinks_written: int = 0
    dirs_made: int = 0
    removed: list[str] = field(default_factory=list)
    unchanged: int = 0

    def summary(self) -> str:
        return (
            f"{self.files_written} files ({self.bytes_written / 1e6:.1f} MB) written, "
            f"{self.links_made} hardlinks, {self.symlinks_written} symlinks, {self.dirs_made} "
            f"dirs made, {len(self.removed)} removed, {self.unchanged} unchanged"
        )


def _same_file(src: os.stat_result, dst: os.stat_result, src_path: str, dst_path: str) -> bool:
    if not stat.S_ISREG(dst.st_mode) or src.st_size != dst.st_size:
        return False
    if (src.st_mode, src.st_uid, src.st_gid) != (dst.st_mode, dst.st_uid, dst.st_gid):
        return False
    if src.st_mtime_ns == dst.st_mtime_ns:
        return True
    return filecmp.cmp(src_path, dst_path, shallow=False)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _write_file(src_path: str, dst_path: str, src: os.stat_result, taken: set[str]) -> None:
    """Copy to a new temporary file beside ``dst_path`` and rename it over ``dst_path``, so
    ``dst_path`` is never half-written. The temporary name is made here (O_EXCL) and is none of
    ``taken`` (the source directory's names), so it is never a file of the source or the
    target; it is removed if anything fails. One a killed run left is not in the source, so
    the next run removes it like any entry only in the target."""
    directory = os.path.dirname(dst_path)
    while True:
        fd, temp = tempfile.mkstemp(prefix=".tree-sync-", dir=directory)
        os.close(fd)
        if os.path.basename(temp) not in taken:
            break
        os.unlink(temp)
    try:
        shutil.copyfile(src_path, temp, follow_symlinks=False)
        os.chown(temp, src.st_uid, src.st_gid)
        os.chmod(temp, stat.S_IMODE(src.st_mode))
        os.utime(temp, ns=(src.st_atime_ns, src.st_mtime_ns))
        if os.path.isdir(dst_path) and not os.path.islink(dst_path):
            shutil.rmtree(dst_path)
        os.replace(temp, dst_path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise


def check_source(source: Path) -> None:
    """Everything the sync will read can be read and copied; SyncError naming each problem.

    Runs before anything is written, so a bad source leaves the target as it was.
    """
    problems: list[str] = []
    # A copy keeps its file's owner and group, which only root may give to another user's.
    owners: list[str] = []
    root = os.geteuid() == 0
    groups = {os.getegid(), *os.getgroups()}

    def unlistable(exc: OSError) -> None:
        problems.append(f"{exc.filename}: cannot list this directory ({exc.strerror})")

    for dirpath, dirnames, filenames in os.walk(source, onerror=unlistable):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            try:
                st = os.lstat(path)
            except OSError as exc:
                problems.append(f"{path}: cannot look at it ({exc.strerror})")
                continue
            if stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode):
                continue
            if not stat.S_ISREG(st.st_mode):
                kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket or device"
                problems.append(f"{path}: {kind}, not a file, directory or symlink")
                continue
            try:  # O_NONBLOCK: should it have turned into a FIFO meanwhile, never hang on it
                os.close(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK))
            except OSError as exc:
                problems.append(f"{path}: cannot read this file ({exc.strerror})")
                continue
            if not root and (st.st_uid != os.geteuid() or st.st_gid not in groups):
                owners.append(f"{path}: belongs to uid {st.st_uid}, gid {st.st_gid}")
    if not problems and owners:
        listed = owners[:_LISTED] + (
            [f"... and {len(owners) - _LISTED} more"] if len(owners) > _LISTED else []
        )
        raise SyncError(
            f"{source} holds files of other users, and a copy keeps its owner and group, "
            f"which only root may give (this is uid {os.geteuid()}); nothing was written:\n  "
            + "\n  ".join(listed)
            + "\nfix: run tree_sync as root, or as the user who owns SOURCE"
        )
    if problems:
        listed = problems[:_LISTED]
        if len(problems) > _LISTED:
            listed.append(f"... and {len(problems) - _LISTED} more")
        raise SyncError(
            f"{source} cannot be copied as it is; nothing was written:\n  "
            + "\n  ".join(listed)
            + "\nfix: remove those entries from the source (a venv holds only files, "
            "directories and symlinks) or make them readable by this user, then run it again"
        )


def _existing(path: Path) -> str:
    """``path`` resolved, or, if it does not exist, the nearest directory above it that does:
    the directory a new TARGET would be made in."""
    real = os.path.realpath(path)
    while not os.path.lexists(real) and real != os.path.dirname(real):
        real = os.path.dirname(real)
    return real


def _chains(path: Path, table: list[mounts.Mount]) -> list[tuple[str, list[tuple[int, int]]]]:
    """For each path that reaches ``path`` (or the nearest existing directory above it; a bind
    mount of it, or of a directory above it, is another such path): that path, and the device
    and inode of it and of every directory above it up to ``/``. These say which directories
    hold it, whichever path names it."""
    found = []
    for alias in mounts.aliases(_existing(path), table):
        ids = [(st.st_dev, st.st_ino) for st in map(os.stat, (alias, *Path(alias).parents))]
        found.append((alias, ids))
    return found


def _nested_as_paths(source: Path, target: Path) -> bool:
    """Whether the resolved paths alone show the two trees to be one or nested."""
    src, dst = os.path.realpath(source), os.path.realpath(target)
    return src == dst or src.startswith(dst.rstrip("/") + "/") or dst.startswith(src + "/")


def _how(source: Path, target: Path, tree: Path, alias: str) -> str:
    """How two trees whose paths look apart are one or nested: the other path of one."""
    if _nested_as_paths(source, target):
        return ""
    existing = _existing(tree)
    if alias == existing:
        return " (the same directory by another path)"
    return f" (the same directory by another path: {existing} is also {alias}, through a mount)"


def check_nesting(source: Path, target: Path) -> None:
    """SyncError unless the two trees are apart: a TARGET that holds SOURCE would delete it
    (everything in TARGET that SOURCE lacks goes), a TARGET inside SOURCE would be copied into
    itself without end, and a mount inside either would carry the sync into another tree.

    A mount point inside either tree is named first (it is the other tree's way in, and
    unmounting it is the fix). Then directories are compared by device and inode, not by path,
    along every path the kernel's mount table shows to reach each tree: a bind mount reaches
    the same directory, or one inside the other tree, by another path. Checked before anything
    is written.
    """
    table = mounts.mounts()
    for role, tree in (("SOURCE", source), ("TARGET", target)):
        if not os.path.lexists(tree):
            continue
        inner = mounts.inside(tree, table)
        if inner:
            raise SyncError(
                f"{role} {tree} holds the mount point {inner[0]}"
                + (f" (and {len(inner) - 1} more)" if len(inner) > 1 else "")
                + ": another tree is mounted inside it, which the sync would "
                + ("copy as its own" if role == "SOURCE" else "empty as not in SOURCE")
                + "; nothing was written\nfix: unmount it, or give trees without mounts inside"
            )
    src_chains = _chains(source, table)
    dst_chains = _chains(target, table)
    src_id = src_chains[0][1][0]
    dst_id = dst_chains[0][1][0] if os.path.lexists(target) else None
    if dst_id == src_id:
        how = _how(source, target, target, dst_chains[0][0])
        raise SyncError(
            f"{source} and {target} are the same directory{how}; nothing was written\n"
            "fix: give two trees"
        )
    for alias, ids in src_chains:
        if dst_id is not None and dst_id in ids[1:]:
            how = _how(source, target, source, alias)
            raise SyncError(
                f"SOURCE {source} is inside TARGET {target}{how}: making TARGET equal to "
                "SOURCE would delete SOURCE; nothing was written\n"
                "fix: give a TARGET that does not hold SOURCE, by any path (through a bind mount "
                "too)"
            )
    for alias, ids in dst_chains:
        if src_id in ids:
            how = _how(source, target, target, alias)
            raise SyncError(
                f"TARGET {target} is inside SOURCE {source}{how}: it would be copied into "
                "itself; nothing was written\nfix: give a TARGET outside SOURCE, by any path "
                "(through a bind mount too)"
            )


def sync_tree(source: Path, target: Path) -> SyncReport:
    """Make ``target`` equal to ``source`` (see the module docstring); returns what changed."""
    if not source.is_dir() or source.is_symlink():
        raise SyncError(f"{source} is not a directory\nfix: give an existing directory as SOURCE")
    check_nesting(source, target)
    check_source(source)
    report = SyncReport()
    written: dict[tuple[int, int], str] = {}  # a source inode -> the target path written for it
    if not target.is_dir() or target.is_symlink():
        if os.path.lexists(target):
            _remove(str(target))
        target.mkdir(parents=True)
        report.dirs_made += 1
    for dirpath, dirnames, filenames in os.walk(source):
        rel = os.path.relpath(dirpath, source)
        here = os.path.normpath(os.path.join(target, rel))
        wanted = set(dirnames) | set(filenames)
        for name in sorted(set(os.listdir(here)) - wanted):
            _remove(os.path.join(here, name))
            report.removed.append(os.path.normpath(os.path.join(rel, name)))
        src_dir = os.lstat(dirpath)
        if stat.S_IMODE(os.lstat(here).st_mode) != stat.S_IMODE(src_dir.st_mode):
            os.chmod(here, stat.S_IMODE(src_dir.st_mode))
        for name in list(dirnames):
            src_path, dst_path = os.path.join(dirpath, name), os.path.join(here, name)
            src = os.lstat(src_path)
            if stat.S_ISLNK(src.st_mode):  # os.walk lists a symlink to a directory here
                dirnames.remove(name)
                _sync_symlink(src_path, dst_path, report)
                continue
            if not (os.path.isdir(dst_path) and not os.path.islink(dst_path)):
                if os.path.lexists(dst_path):
                    _remove(dst_path)
                os.mkdir(dst_path, stat.S_IMODE(src.st_mode))
                report.dirs_made += 1
        for name in filenames:
            src_path, dst_path = os.path.join(dirpath, name), os.path.join(here, name)
            src = os.lstat(src_path)
            if stat.S_ISLNK(src.st_mode):
                _sync_symlink(src_path, dst_path, report)
            elif stat.S_ISREG(src.st_mode):
                _sync_file(src_path, dst_path, src, written, report, wanted)
            else:
                raise SyncError(f"{src_path}: not a file, directory or symlink")
    return report


def _sync_symlink(src_path: str, dst_path: str, report: SyncReport) -> None:
    link = os.readlink(src_path)
    if os.path.islink(dst_path) and os.readlink(dst_path) == link:
        report.unchanged += 1
        return
    if os.path.lexists(dst_path):
        _remove(dst_path)
    os.symlink(link, dst_path)
    report.symlinks_written += 1


def _sync_file(
    src_path: str,
    dst_path: str,
    src: os.stat_result,
    written: dict[tuple[int, int], str],
    report: SyncReport,
    taken: set[str],
) -> None:
    key = (src.st_dev, src.st_ino)
    try:
        dst = os.lstat(dst_path)
    except FileNotFoundError:
        dst = None
    if key in written:  # the source's hardlink to a file written above: the same here
        first = written[key]
        if dst is not None and os.path.samefile(first, dst_path):
            report.unchanged += 1
            return
        if dst is not None:
            _remove(dst_path)
        os.link(first, dst_path)
        report.links_made += 1
        return
    if dst is not None and _same_file(src, dst, src_path, dst_path):
        report.unchanged += 1
        return
    _write_file(src_path, dst_path, src, taken)
    if src.st_nlink > 1:
        written[key] = dst_path
    report.files_written += 1
    report.bytes_written += src.st_size


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.Parser(
        prog="tree_sync",
        description=(
            "Make TARGET equal to SOURCE, writing only the entries that differ: the same "
            "paths and types, files of the same size, mode and owner with the same mtime "
            "(rsync's quick check) or the same bytes, symlinks with the same target, "
            "directories with the same mode; entries only in TARGET are removed. Changed "
            "files are written to a temporary name and renamed into place, so a file "
            "hardlinked elsewhere keeps its content there. The source is checked first: a "
            "FIFO, socket, device, unreadable file or unlistable directory in it refuses the "
            "sync before anything is written, as do trees that are one or nested (compared "
            "by device and inode along every path the mount table gives each, so a bind mount "
            "of either tree or of a directory in it counts), a mount point inside either tree, "
            "and, for a user who is not root, other users' files (a copy keeps its owner). "
            "rsync -a --delete, without needing rsync; the "
            "image's multi-backend stage uses it (python3 -m ep_image.build_steps.image_stage)."
        ),
        epilog=(
            "Exit codes: 0 equal now; 1 refused or failed (the message names the path and the "
            "fix); 2 bad usage. Example: python3 -m ep_image.build_steps.tree_sync "
            "/mnt/ep-BACKEND/BACKEND /opt/venvs/BACKEND"
        ),
    )
    parser.add_argument("source", type=Path, metavar="SOURCE", help="the tree to copy")
    parser.add_argument("target", type=Path, metavar="TARGET", help="made equal to SOURCE")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    try:
        report = sync_tree(args.source, args.target)
    except SyncError as exc:
        print(f"tree_sync: refused: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"tree_sync: failed: {exc}", file=sys.stderr)
        fix = cli.os_error_fix(exc, args.target, _access_fix(exc))
        print(
            f"tree_sync: fix: {fix}, then run it again (files are replaced whole, but the "
            "target may be partly updated)",
            file=sys.stderr,
        )
        return 1
    print(f"tree_sync: {args.source} -> {args.target}: {report.summary()}")
    return 0


def _access_fix(exc: OSError) -> str:
    """The fix for a system error that is not a full or read-only disk: name the path."""
    where = exc.filename or "TARGET"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return (
            f"give this user access to {where}, or run tree_sync as root (it keeps every "
            "file's owner, which only root may give to another user's file)"
        )
    return f"check {where} (the error above names it)"


def main(argv: Sequence[str] | None = None) -> int:
    return cli.run("tree_sync", parse_args, run, argv, terminate_cleanly=True)


if __name__ == "__main__":
    sys.exit(main())
