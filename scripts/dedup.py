"""Hardlink identical regular files across directory trees (per-backend venvs).

Why: an image or host prefix holds one venv per EP backend, and each venv carries the same
~5 GB of torch, CUDA libraries and friends. Linking identical files makes N venvs cost about one
on disk and in an image layer, while each venv stays a complete, independent-looking tree.

What it guarantees (each rule is tested in tests/test_dedup.py):
- Only regular files are linked; symlinks, devices, sockets and directories are never touched,
  and the walk never follows symlinks nor descends into another filesystem (like ``find -xdev``).
- All ROOTs must live on one filesystem (hardlinks cannot cross one); otherwise the run is
  refused before anything changes, with exit code 2. Run it once per filesystem instead.
- Files are linked only when their content is equal: same size, same SHA-256, then a
  byte-for-byte comparison just before linking.
- Files are linked only when linking changes nothing else a program can see: same permission
  bits, owner, group and extended attributes (an inode has one of each). A ``.py`` file whose
  ``__pycache__`` holds a timestamp-validated ``.pyc`` is linked only to a file with the same
  mtime (in seconds), because the shared inode has one mtime and a mismatch would silently make
  that venv's bytecode stale.
- Every path holds a complete file at every instant: the duplicate is replaced by first linking
  the kept file to a temporary name in the same directory, then ``os.replace`` over the
  duplicate. A crash leaves at most one extra temporary link (``.dedup-tmp-*``), removed by the
  next run.
- Files that tools rewrite in place are left alone by default (``pyvenv.cfg``, ``*.pth``, the
  venv's ``bin/activate*`` scripts, a dist's ``RECORD``/``INSTALLER``/``REQUESTED``/
  ``direct_url.json``, ``ep-backend.json``); they are small, so nothing is lost.
- A second run finds every duplicate already sharing one inode and changes nothing.

The hazard of hardlinked venvs, and why installers are safe: a write *into* a shared inode
changes every venv that links it. uv and pip never do that on install, reinstall, upgrade or
uninstall: uninstall unlinks files, and installs create new files (pip unlinks an existing
target before writing; uv links or copies to a path that uninstall has just removed, and in
hardlink/clone mode replaces an existing target by rename). See docs/host-mode.md, "Hardlinked
venvs and installers", and the test that reinstalls and upgrades a package in one deduplicated
venv and proves the other venv's bytes did not change. What remains unsafe is editing an
installed file in place (an editor, ``sed -i`` is fine as it renames, ``open(path, "w")`` is
not); ``--read-only`` removes the write bits of every inode shared by paths under the ROOTs,
so such a write fails for non-root users (root ignores permission bits, so in an image it is
documentation, not a lock). It leaves alone inodes that are also linked from outside the ROOTs
(uv's cache in its default hardlink mode), whose mode is not this run's to change.
``--read-only`` is the one option that changes modes, and it changes them on purpose.

Test hook: ``EP_DEDUP_TEST_CRASH_AFTER=N`` kills the process with SIGKILL right after the
(N+1)th temporary link is made and before it replaces the duplicate: the worst moment to crash.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import re
import signal
import stat
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

#: Paths (relative to a root; a pattern without "/" matches the file name) never linked by
#: default: small files that tools rewrite in place, where a shared inode would leak a write.
DEFAULT_EXCLUDES: tuple[str, ...] = (
    "pyvenv.cfg",
    "*.pth",
    "bin/activate*",
    "bin/deactivate*",
    "*.dist-info/RECORD",
    "*.dist-info/INSTALLER",
    "*.dist-info/REQUESTED",
    "*.dist-info/direct_url.json",
    "ep-backend.json",
)

TEMP_PREFIX = ".dedup-tmp-"
_TEMP_RE = re.compile(r"^\.dedup-tmp-[0-9a-f]+-[0-9]+$")
_CHUNK = 1 << 20
_WRITE_BITS = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH
CRASH_ENV = "EP_DEDUP_TEST_CRASH_AFTER"


class DedupError(Exception):
    """A reason to refuse the whole run before anything changes (exit code 2)."""


@dataclass(frozen=True)
class FileInfo:
    """A regular file as seen by the scan (lstat)."""

    path: Path
    dev: int
    ino: int
    size: int
    mode: int
    uid: int
    gid: int
    mtime_ns: int

    @property
    def inode(self) -> tuple[int, int]:
        return (self.dev, self.ino)


@dataclass
class Report:
    """What a run did, printed and optionally written as JSON."""

    roots: list[str]
    device: int
    dry_run: bool
    read_only: bool
    files_scanned: int = 0
    inodes_before: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    files_linked: int = 0
    inodes_merged: int = 0
    files_made_read_only: int = 0
    stale_temps_removed: int = 0
    seconds: float = 0.0
    skipped: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def skip(self, reason: str, count: int = 1) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + count


# --------------------------------------------------------------------------- roots and scan


def resolve_roots(roots: Iterable[str | Path]) -> tuple[list[Path], int]:
    """Absolute, existing, non-nested roots on one device; DedupError otherwise."""
    resolved: list[Path] = []
    for root in roots:
        path = Path(root).resolve()
        if not path.is_dir():
            raise DedupError(f"{root}: not a directory (each ROOT must be an existing tree)")
        resolved.append(path)
    devices = {path: os.stat(path).st_dev for path in resolved}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{p} (device {d})" for p, d in devices.items())
        raise DedupError(
            "ROOTs are on different filesystems and hardlinks cannot cross filesystems: "
            f"{listing}. Nothing was changed. Run dedup once per filesystem, or move the "
            "trees onto one filesystem first."
        )
    kept = [p for p in sorted(set(resolved)) if not any(q in p.parents for q in resolved)]
    return kept, devices[resolved[0]]


def _walk(root: Path, device: int, report: Report) -> Iterator[tuple[Path, os.stat_result]]:
    """Yield (path, lstat) of every regular file under root, staying on ``device``."""
    stack = [root]
    while stack:
        directory = stack.pop()
        try:
            entries = list(os.scandir(directory))
        except OSError as exc:
            report.failures.append(f"cannot list {directory}: {exc}")
            continue
        for entry in entries:
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                if st.st_dev != device:
                    report.skip("directories on another filesystem (not descended)")
                else:
                    stack.append(Path(entry.path))
            elif stat.S_ISREG(st.st_mode):
                yield Path(entry.path), st
            elif stat.S_ISLNK(st.st_mode):
                report.skip("symlinks")
            else:
                report.skip("devices, sockets, fifos")


def is_excluded(relative: str, patterns: Iterable[str]) -> bool:
    """True if ``relative`` (posix, under a root) matches a pattern.

    A pattern without "/" matches the file name; one with "/" matches the path's last
    components (``bin/activate*`` matches ``deepep_v1/bin/activate``).
    """
    parts = relative.split("/")
    for pattern in patterns:
        depth = pattern.count("/") + 1
        if fnmatch.fnmatchcase("/".join(parts[-depth:]), pattern):
            return True
    return False


def scan(
    roots: list[Path],
    device: int,
    excludes: tuple[str, ...],
    min_size: int,
    report: Report,
) -> list[FileInfo]:
    """Every candidate file under ``roots``; also fills the report's before-figures.

    Removes temporary links a crashed run left behind (they are extra names of kept files).
    """
    seen: set[tuple[int, int]] = set()
    candidates: list[FileInfo] = []
    for root in roots:
        for path, st in _walk(root, device, report):
            if _TEMP_RE.match(path.name):
                _remove_stale_temp(path, report)
                continue
            report.files_scanned += 1
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                report.bytes_before += st.st_size
            if is_excluded(path.relative_to(root).as_posix(), excludes):
                report.skip("excluded (rewritten in place by tools)")
            elif st.st_size < min_size:
                report.skip(f"smaller than --min-size {min_size}")
            else:
                candidates.append(_info(path, st))
    report.inodes_before = len(seen)
    return candidates


def _info(path: Path, st: os.stat_result) -> FileInfo:
    return FileInfo(
        path=path,
        dev=st.st_dev,
        ino=st.st_ino,
        size=st.st_size,
        mode=stat.S_IMODE(st.st_mode),
        uid=st.st_uid,
        gid=st.st_gid,
        mtime_ns=st.st_mtime_ns,
    )


def _remove_stale_temp(path: Path, report: Report) -> None:
    if report.dry_run:
        report.skip("stale temporary links (removed on a real run)")
        return
    path.unlink()
    report.stale_temps_removed += 1


# --------------------------------------------------------------------------- grouping


def sha256_of(path: Path) -> str:
    """SHA-256 of a file's bytes."""
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def same_bytes(a: Path, b: Path) -> bool:
    """Byte-for-byte equality, read in 1 MiB chunks (the last word before linking)."""
    with a.open("rb") as fa, b.open("rb") as fb:
        while True:
            chunk_a, chunk_b = fa.read(_CHUNK), fb.read(_CHUNK)
            if chunk_a != chunk_b:
                return False
            if not chunk_a:
                return True


@lru_cache(maxsize=4096)
def _pycache_listing(directory: Path) -> tuple[str, ...]:
    try:
        return tuple(os.listdir(directory / "__pycache__"))
    except OSError:
        return ()


def bytecode_pins_mtime(info: FileInfo) -> bool:
    """True if a timestamp-validated .pyc in ``__pycache__`` records this source's mtime.

    Such a .pyc is valid only while the source keeps its mtime; a shared inode keeps the kept
    file's mtime, so linking would make this venv's bytecode stale.
    """
    if info.path.suffix != ".py":
        return False
    stem = info.path.stem + "."
    for name in _pycache_listing(info.path.parent):
        if name.startswith(stem) and name.endswith(".pyc"):
            try:
                with (info.path.parent / "__pycache__" / name).open("rb") as fh:
                    header = fh.read(16)
            except OSError:
                continue
            if len(header) == 16 and int.from_bytes(header[4:8], "little") & 1 == 0:
                return True
    return False


def _xattrs(path: Path) -> tuple[tuple[str, bytes], ...]:
    try:
        names = os.listxattr(path, follow_symlinks=False)
        return tuple(sorted((n, os.getxattr(path, n, follow_symlinks=False)) for n in names))
    except OSError:
        return ()


def metadata_key(info: FileInfo, read_only: bool) -> tuple:
    """What must be equal, besides content, for a link to change nothing visible."""
    mode = info.mode & ~_WRITE_BITS if read_only else info.mode
    pinned = info.mtime_ns // 1_000_000_000 if bytecode_pins_mtime(info) else None
    return (mode, info.uid, info.gid, _xattrs(info.path), pinned)


def _inodes(files: Iterable[FileInfo]) -> dict[tuple[int, int], list[FileInfo]]:
    by_inode: dict[tuple[int, int], list[FileInfo]] = defaultdict(list)
    for info in files:
        by_inode[info.inode].append(info)
    return by_inode


def duplicate_sets(
    candidates: list[FileInfo], read_only: bool, report: Report, jobs: int
) -> list[list[list[FileInfo]]]:
    """Sets of inodes that may be merged; each inode is given as the list of its paths.

    Size first (free), then SHA-256 of one path per inode (only where a size is shared by two
    or more inodes), then the metadata key; the byte comparison happens at link time.
    """
    by_size: dict[int, list[FileInfo]] = defaultdict(list)
    for info in candidates:
        by_size[info.size].append(info)
    to_hash: list[list[FileInfo]] = []
    for files in by_size.values():
        inodes = _inodes(files)
        if len(inodes) > 1:
            to_hash.extend(inodes.values())
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        digests = list(pool.map(lambda paths: sha256_of(paths[0].path), to_hash))
    by_content: dict[tuple[int, str], list[list[FileInfo]]] = defaultdict(list)
    for paths, digest in zip(to_hash, digests, strict=True):
        by_content[(paths[0].size, digest)].append(paths)
    result: list[list[list[FileInfo]]] = []
    for inode_lists in by_content.values():
        if len(inode_lists) < 2:
            continue
        by_meta: dict[tuple, list[list[FileInfo]]] = defaultdict(list)
        for paths in inode_lists:
            by_meta[metadata_key(paths[0], read_only)].append(paths)
        if len(by_meta) > 1:
            report.skip(
                "identical content kept apart (mode, owner, xattrs or bytecode-pinned mtime "
                "differ)",
                sum(len(p) for group in by_meta.values() for p in group),
            )
        result.extend(group for group in by_meta.values() if len(group) > 1)
    return result


# --------------------------------------------------------------------------- linking


class _CrashHook:
    """Test hook: SIGKILL after N links, between making the temp link and the rename."""

    def __init__(self) -> None:
        value = os.environ.get(CRASH_ENV)
        self.remaining = int(value) if value else None

    def maybe_crash(self) -> None:
        if self.remaining is None:
            return
        if self.remaining == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        self.remaining -= 1


def _unchanged(info: FileInfo) -> bool:
    try:
        st = os.lstat(info.path)
    except OSError:
        return False
    return (
        stat.S_ISREG(st.st_mode)
        and (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        == (info.dev, info.ino, info.size, info.mtime_ns)
        and stat.S_IMODE(st.st_mode) == info.mode
    )


def replace_with_link(keep: FileInfo, dup: FileInfo, hook: _CrashHook) -> None:
    """Make ``dup.path`` a hardlink of ``keep.path``; the path is never missing or partial."""
    token = f"{os.getpid():x}-{time.monotonic_ns()}"
    temp = dup.path.parent / f"{TEMP_PREFIX}{token}"
    os.link(keep.path, temp)
    try:
        hook.maybe_crash()
        os.replace(temp, dup.path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def choose_keeper(inode_lists: list[list[FileInfo]]) -> list[FileInfo]:
    """The inode to keep: the one with most paths here (fewest renames), then first path."""
    return min(inode_lists, key=lambda paths: (-len(paths), str(min(p.path for p in paths))))


def merge_set(inode_lists: list[list[FileInfo]], report: Report, hook: _CrashHook) -> None:
    """Link every inode in one duplicate set to the kept one, after a byte comparison."""
    keep_paths = choose_keeper(inode_lists)
    keep = keep_paths[0]
    for paths in inode_lists:
        if paths is keep_paths:
            continue
        if not same_bytes(keep.path, paths[0].path):
            report.skip("same SHA-256 but different bytes", len(paths))
            continue
        merged_all = True
        for dup in paths:
            if report.dry_run:
                report.files_linked += 1
                continue
            if not (_unchanged(keep) and _unchanged(dup)):
                report.skip("changed during the run (left as is)")
                merged_all = False
                continue
            try:
                replace_with_link(keep, dup, hook)
            except OSError as exc:
                report.failures.append(f"{dup.path}: {exc}")
                merged_all = False
                continue
            report.files_linked += 1
        if merged_all:
            report.inodes_merged += 1
            report.bytes_after -= keep.size


def protect_shared(candidates: list[FileInfo], report: Report) -> None:
    """--read-only: clear the write bits of every inode that two or more paths here share.

    Runs after linking, on fresh lstat data, so inodes shared by an earlier run count too.
    An inode that also has links outside the ROOTs (uv's cache, another project's venv) is
    left as is: changing its mode would reach files this run was not asked to touch.
    """
    paths_by_inode: dict[tuple[int, int], list[Path]] = defaultdict(list)
    for info in candidates:
        try:
            st = os.lstat(info.path)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            paths_by_inode[(st.st_dev, st.st_ino)].append(info.path)
    for paths in paths_by_inode.values():
        if len(paths) < 2:
            continue
        st = os.lstat(paths[0])
        if st.st_nlink > len(paths):
            report.skip("read-only not applied: also linked from outside the ROOTs", len(paths))
        elif stat.S_IMODE(st.st_mode) & _WRITE_BITS:
            os.chmod(paths[0], stat.S_IMODE(st.st_mode) & ~_WRITE_BITS, follow_symlinks=False)
            report.files_made_read_only += len(paths)


# --------------------------------------------------------------------------- driver


def dedup(
    roots: Iterable[str | Path],
    *,
    dry_run: bool = False,
    read_only: bool = False,
    excludes: tuple[str, ...] = DEFAULT_EXCLUDES,
    min_size: int = 1,
    jobs: int = 2,
) -> Report:
    """Deduplicate ``roots`` and return the report (DedupError: refused, nothing changed)."""
    started = time.monotonic()
    paths, device = resolve_roots(roots)
    report = Report(
        roots=[str(p) for p in paths], device=device, dry_run=dry_run, read_only=read_only
    )
    candidates = scan(paths, device, excludes, min_size, report)
    report.bytes_after = report.bytes_before
    hook = _CrashHook()
    for inode_lists in duplicate_sets(candidates, read_only, report, jobs):
        merge_set(inode_lists, report, hook)
    if read_only and not dry_run:
        protect_shared(candidates, report)
    report.seconds = round(time.monotonic() - started, 3)
    return report


def human(n: int) -> str:
    """Bytes as GiB/MiB/KiB with two decimals."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.2f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    raise AssertionError("unreachable")


def print_report(report: Report) -> None:
    verb = "would link" if report.dry_run else "linked"
    print(f"dedup: roots {' '.join(report.roots)} (device {report.device})")
    print(f"dedup: {report.files_scanned} regular files, {report.inodes_before} inodes")
    print(f"dedup: {verb} {report.files_linked} files, {report.inodes_merged} inodes merged")
    saved = report.bytes_before - report.bytes_after
    print(
        f"dedup: bytes before {report.bytes_before} ({human(report.bytes_before)}), "
        f"after {report.bytes_after} ({human(report.bytes_after)}), saved {human(saved)}"
    )
    if report.read_only:
        print(f"dedup: made read-only: {report.files_made_read_only} paths")
    if report.stale_temps_removed:
        print(f"dedup: removed {report.stale_temps_removed} temporary links of a crashed run")
    for reason, count in sorted(report.skipped.items()):
        print(f"dedup: not linked: {reason}: {count}")
    for failure in report.failures:
        print(f"dedup: FAILED: {failure}", file=sys.stderr)
    print(f"dedup: {report.seconds:.1f} s")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="dedup.py",
        description=(
            "Hardlink identical regular files across the given trees, so several venvs cost "
            "about one. Only files with equal bytes (size, SHA-256, then a byte comparison) "
            "and equal mode, owner, group and xattrs are linked; each duplicate is replaced "
            "atomically (link to a temporary name, then rename), so every path always holds a "
            "complete file. All ROOTs must be on one filesystem. A second run is a no-op."
        ),
        epilog=(
            "Exit codes: 0 done; 1 some files could not be linked (listed, all others done); "
            "2 refused before changing anything (bad ROOT, ROOTs on different filesystems). "
            "Example: python scripts/dedup.py --json /tmp/dedup.json /opt/venvs/deepep_v1 "
            "/opt/venvs/deepep_v2"
        ),
    )
    parser.add_argument("roots", nargs="+", metavar="ROOT", help="a tree to deduplicate")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="hash and compare everything, print what would be linked, change nothing",
    )
    parser.add_argument("--json", metavar="PATH", type=Path, help="also write the report here")
    parser.add_argument(
        "--read-only",
        action="store_true",
        help=(
            "clear the write bits of every inode shared by two or more paths, so an in-place "
            "write into one venv fails instead of changing the others (not for root, which "
            "ignores permission bits). Installers still work: they unlink, never write in place"
        ),
    )
    parser.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="PATTERN",
        help=(
            "never link paths matching PATTERN (fnmatch; without '/' it matches the file name, "
            "with '/' the path's last components); repeatable, adds to the defaults"
        ),
    )
    parser.add_argument(
        "--no-default-excludes",
        action="store_true",
        help=f"drop the default excludes ({', '.join(DEFAULT_EXCLUDES)})",
    )
    parser.add_argument(
        "--min-size",
        type=int,
        default=1,
        metavar="BYTES",
        help="skip files smaller than this (default 1: empty files save nothing)",
    )
    parser.add_argument(
        "--jobs", type=int, default=min(4, os.cpu_count() or 1), help="hashing threads"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    excludes = () if args.no_default_excludes else DEFAULT_EXCLUDES
    try:
        report = dedup(
            args.roots,
            dry_run=args.dry_run,
            read_only=args.read_only,
            excludes=excludes + tuple(args.exclude),
            min_size=args.min_size,
            jobs=args.jobs,
        )
    except DedupError as exc:
        print(f"dedup: refused: {exc}", file=sys.stderr)
        return 2
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=2) + "\n")
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
