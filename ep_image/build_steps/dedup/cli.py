"""Hardlink identical regular files across directory trees (per-backend venvs): the command.

N venvs that carry the same torch and CUDA libraries then cost about one. util-linux
``hardlink`` finds and links (``hardlink.py``); this command adds what it does not guarantee: one
filesystem, the excludes, the bytecode rule, ``--read-only`` (``read_only.py``) and a report in
``du``'s terms (``report.py``, from the walks of ``tree.py``). See docs/host-mode.md, sections
"Deduplicating venvs" and "Hardlinked venvs and installers".
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from ep_image import cli
from ep_image.build_steps.dedup import leftovers, overlay
from ep_image.build_steps.dedup import read_only as read_only_mode
from ep_image.build_steps.dedup.hardlink import find_hardlink, hardlink_argv, run_hardlink
from ep_image.build_steps.dedup.report import (
    Report,
    account,
    predict,
    print_report,
    write_report,
)
from ep_image.build_steps.dedup.tree import JOURNALS, DedupError, glob_to_regex, literal_regex, scan
from ep_image.files import mounts

PROG = "dedup"
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
#: The two passes of the bytecode rule: everything but .py files, then only .py files.
_PY = r"\.py$"
_NOT_PY = r"([^.]..|.[^p].|..[^y])$"


#: Trees no ROOT may be: the file system's root and its system directories (a dedup of ``/``
#: would walk, and hardlink, the whole machine). Only these exact tops: ``/mnt/data/venvs``
#: is a ROOT like any other, ``/mnt`` (every mounted disk) is not.
SYSTEM_TREES = frozenset(
    {"/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/libx32",
     "/media", "/mnt", "/opt", "/proc", "/root", "/run", "/sbin", "/snap", "/srv", "/sys",
     "/tmp", "/usr", "/var", "/var/tmp"}
)  # fmt: skip


def resolve_roots(roots: Iterable[str | Path]) -> tuple[list[Path], int]:
    """Absolute, existing, non-nested roots on one device, none a system tree; DedupError
    otherwise."""
    resolved: list[Path] = []
    for root in roots:
        path = Path(root).resolve()
        if not path.is_dir():
            raise DedupError(
                f"{root}: not a directory", "give each ROOT as an existing directory tree"
            )
        if str(path) in SYSTEM_TREES:
            raise DedupError(
                f"{root} is {path}, a system tree, not a tree of venvs. Nothing was changed.",
                "give the venvs' directories as ROOTs (e.g. /opt/venvs/BACKEND, one per venv)",
            )
        resolved.append(path)
    devices = {path: os.stat(path).st_dev for path in resolved}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{p} (device {d})" for p, d in devices.items())
        raise DedupError(
            "ROOTs are on different filesystems and hardlinks cannot cross filesystems: "
            f"{listing}. Nothing was changed.",
            "run dedup once per filesystem, or move the trees onto one filesystem first",
        )
    kept = _one_path_per_tree(resolved)
    table = mounts.mounts()
    where = {p: getattr(mounts.mount_of(p, table), "mount_point", "/") for p in kept}
    if len(set(where.values())) > 1:
        listing = ", ".join(f"{p} (mounted at {m})" for p, m in where.items())
        raise DedupError(
            "ROOTs are on different mounts of one filesystem (a bind mount is one), and "
            f"hardlinks cannot cross mounts: {listing}. Nothing was changed.",
            "give every ROOT by a path on one mount (the same trees without the bind mount), "
            "or run dedup once per mount",
        )
    return kept, devices[resolved[0]]


def _one_path_per_tree(paths: list[Path]) -> list[Path]:
    """``paths`` without those that name a tree another one holds or is: compared by device and
    inode, so a bind mount (the same directory by another path) or a tree inside another
    through one counts too. Of two paths to one directory the first in order is kept."""
    chains = {
        path: [(st.st_dev, st.st_ino) for st in map(os.stat, (path, *path.parents))]
        for path in sorted(set(paths))
    }
    kept: list[Path] = []
    for path, chain in chains.items():
        if any(chains[other][0] in chain for other in kept):
            continue  # the same tree as one kept, or inside it
        kept = [other for other in kept if chain[0] not in chains[other][1:]]
        kept.append(path)
    return kept


def is_excluded(relative: str, patterns: Iterable[str]) -> bool:
    """True if ``relative`` (posix, under a root) matches one of the fnmatch ``patterns``."""
    return any(re.search(glob_to_regex(p), "/" + relative) for p in patterns)


def dedup(
    roots: Iterable[str | Path],
    *,
    dry_run: bool = False,
    read_only: bool = False,
    excludes: tuple[str, ...] = DEFAULT_EXCLUDES,
    min_size: int = 1,
) -> Report:
    """Deduplicate ``roots`` and return the report (DedupError: refused, nothing changed)."""
    started = time.monotonic()
    paths, device = resolve_roots(roots)
    with lock_roots(paths):
        return _dedup(paths, device, started, dry_run, read_only, excludes, min_size)


@contextlib.contextmanager
def lock_roots(paths: list[Path]) -> Iterator[None]:
    """Lock each ROOT exclusively and every directory above it shared, for the run.

    Why: a second dedup of the same trees, or of a tree inside or around them, would walk them
    while the first links them, and book what it did not do. A run on ``p`` (``p`` exclusive)
    and one on ``p/a`` (``p`` shared) exclude each other; runs on ``p/a`` and ``p/b`` do not.
    """
    with contextlib.ExitStack() as stack:
        # Top down, in one order for every run: of two runs that overlap one is refused, never
        # both.
        wanted = {parent: fcntl.LOCK_SH for path in paths for parent in path.parents}
        wanted |= dict.fromkeys(paths, fcntl.LOCK_EX)
        for path in sorted(wanted, key=lambda p: (len(p.parts), str(p))):
            root = wanted[path] == fcntl.LOCK_EX
            what = f"{path} or a tree inside it" if root else str(path)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
                stack.callback(os.close, fd)
                fcntl.flock(fd, wanted[path] | fcntl.LOCK_NB)
            except BlockingIOError:
                raise DedupError(
                    f"another dedup run is working on {what}. Nothing was changed.",
                    "wait for it to end (its report is the one to read), then run again if needed",
                ) from None
            except OSError:
                if root:
                    raise
                # An ancestor this user cannot open or lock: no run of this user's holds it.
        yield


def _dedup(
    paths: list[Path],
    device: int,
    started: float,
    dry_run: bool,
    read_only: bool,
    excludes: tuple[str, ...],
    min_size: int,
) -> Report:
    binary, version = find_hardlink()
    layer = overlay.layer_of(paths[0])
    if layer is not None and layer.upper is None and read_only and not dry_run:
        raise DedupError(
            f"the ROOTs are on overlayfs (a container layer, mounted at {layer.mount_point}) "
            "whose upper directory is not visible here: --read-only changes the mode of every "
            "shared file, and changing one that lies in a lower layer copies it whole into this "
            "layer. Nothing was changed.",
            "run without --read-only (in an image, built and run as root, write bits protect "
            "nothing: docs/host-mode.md), or where the layer's upper directory is visible",
        )
    report = Report(
        roots=[str(p) for p in paths], device=device, dry_run=dry_run, read_only=read_only
    )
    report.tool = version
    regexes = [glob_to_regex(p) for p in excludes]
    regexes += [
        literal_regex(str(p / (name + tmp)))
        for p in paths
        for name in JOURNALS
        for tmp in ("", ".tmp")
    ]
    exclude = re.compile("|".join(regexes))
    skipped: Counter[str] = Counter()

    # A killed run's records first: the walk below must see the modes as they were, and not
    # the temporary links its hardlink left.
    read_only_mode.restore_journals(paths, report, dry_run=dry_run)
    killed = leftovers.read(paths, report)
    leftovers.clean(paths, killed, report, dry_run=dry_run)
    if not dry_run:
        leftovers.drop(list(killed))
    before = scan(
        paths,
        device,
        exclude,
        min_size,
        skipped,
        find_timestamp_pyc=True,
        keep_paths=read_only,
        index_paths=True,
    )
    left = overlay.leave_alone(before, layer, paths) if layer is not None else None
    if left is not None:
        skipped.update(left.counts)
    clear = read_only_mode.to_clear(before) if read_only else {}
    apart = read_only_mode.keep_apart(before, clear) if read_only else []
    if dry_run:
        clear = {}  # nothing is changed; the excludes above are the real run's
    apart_regexes = read_only_mode.apart_excludes(apart)
    if apart:
        skipped[
            "also linked from outside the ROOTs: kept apart from their copies (--read-only)"
        ] = len(apart)
    if clear:
        read_only_mode.write_journals(before, clear, paths)

    record = leftovers.RunRecord.of(before, device)
    if not dry_run:
        leftovers.write(paths, record)
    report.book_before(before)

    # The passes: one with --ignore-time; under the bytecode rule, .py files apart, by mtime.
    base = regexes + [literal_regex(d) for d in before.other_filesystems]
    base += apart_regexes + (left.regexes if left is not None else [])
    passes = [(True, base)]
    if before.timestamp_pyc:
        passes = [(True, [*base, _PY]), (False, [*base, _NOT_PY])]
    changed = read_only_mode.clear_write_bits(before, clear, report)
    layer_before = overlay.measure(layer, paths) if layer is not None else 0
    pairs: list[tuple[str, str]] = []
    stopped = False
    for ignore_time, regex_list in passes:
        argv = hardlink_argv(
            binary, paths, regex_list, ignore_time=ignore_time, dry_run=dry_run,
            min_size=min_size, respect_xattrs=layer is None,
        )  # fmt: skip
        run = run_hardlink(argv)
        report.commands.append(argv)
        report.failures += run.failures
        pairs += run.pairs
        stopped = stopped or run.returncode != 0

    if dry_run:
        after = predict(before, pairs)
        report.files_linked = len(pairs)
        replaced = {before.index[r] for _, r in pairs if r in before.index}
    else:
        if stopped:  # killed between a temporary link and its rename: that link is left
            leftovers.clean(paths, dict.fromkeys(paths, record), report, dry_run=False)
        after = scan(
            paths, device, exclude, min_size, Counter(), keep_paths=read_only, index_paths=True
        )
        # Read back, not taken from hardlink's records: a killed hardlink's are lost in its
        # output buffer. A path linked now holds another inode the walk before found.
        moved = {
            path: old
            for path, old in before.index.items()
            if (new := after.index.get(path)) not in (None, old) and new in before.files
        }
        report.files_linked = len(moved)
        replaced = set(moved.values())
    for root in sorted(set(before.vanished_roots + after.vanished_roots)):
        report.failures.append(
            f"{root}: this ROOT vanished while dedup ran (removed or renamed by another "
            "process); its files are left out of the figures; run dedup again on the trees "
            "that exist"
        )
    account(before, after, replaced, report)
    if layer is not None:
        layer_after = overlay.measure(layer, paths) if not dry_run else layer_before
        layer.figures = {"layer_bytes_before": layer_before, "layer_bytes_after": layer_after}
        if not dry_run:  # what the layer gained, not what `du` of the merged view says
            report.saved_bytes = layer_before - layer_after
            report.shared_not_freed_bytes = 0
        report.overlay = layer.to_json()
    if read_only and not dry_run:
        read_only_mode.settle_modes(after, changed, report)
        read_only_mode.drop_journals(paths)
    if not dry_run:
        leftovers.drop(paths)
    for reason, count in skipped.items():
        report.skipped[reason] = report.skipped.get(reason, 0) + count
    report.seconds = round(time.monotonic() - started, 3)
    return report


# --------------------------------------------------------------------------- command line


def _size(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: give a whole number of bytes, 0 or more (e.g. 4096)"
        )
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.Parser(
        prog=PROG,
        description=(
            "Hardlink identical regular files across the given trees, so several venvs cost "
            "about one. util-linux hardlink links files with equal bytes, mode, owner, group "
            "and xattrs, each duplicate replaced atomically (link to a temporary name, then "
            "rename); this command adds the same-filesystem check, the excludes, the bytecode "
            "rule, --read-only and a report in du's terms. A second run is a no-op."
        ),
        epilog=(
            "Exit codes: 0 done; 1 some files could not be linked or hardlink stopped early "
            "(listed; run again to finish); 2 refused before changing anything (bad usage, "
            "bad ROOT, ROOTs on different filesystems, no util-linux hardlink >= 2.38). "
            "Example: python3 -m ep_image.build_steps.dedup --json /tmp/dedup.json "
            "/opt/venvs/one /opt/venvs/two"
        ),
    )
    parser.add_argument("roots", nargs="+", metavar="ROOT", help="a tree to deduplicate")
    parser.add_argument(
        "--dry-run", action="store_true", help="compare everything, report, change nothing"
    )
    parser.add_json("also write the report here (checked before anything changes)")
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
        type=_size,
        default=1,
        metavar="BYTES",
        help="skip files smaller than this (default 1: empty files save nothing)",
    )
    return parser.parse_args(argv)


def command(*args: str | os.PathLike[str]) -> list[str]:
    """How another build step runs dedup: in a process of its own (run it with
    ``ep_image.child_env()``), so that its report and exit code are dedup's own."""
    return [sys.executable, "-m", "ep_image.build_steps.dedup", *map(str, args)]


def run(args: argparse.Namespace) -> int:
    excludes = () if args.no_default_excludes else DEFAULT_EXCLUDES
    try:
        report = dedup(
            args.roots,
            dry_run=args.dry_run,
            read_only=args.read_only,
            excludes=excludes + tuple(args.exclude),
            min_size=args.min_size,
        )
    except KeyboardInterrupt:
        raise cli.FixableError(
            "interrupted: every path still holds a complete file",
            "run dedup again to finish (it also gives back write bits an interrupted "
            "--read-only run cleared)",
            cli.EXIT_INTERRUPTED,
        ) from None
    print_report(report)
    if args.json:
        try:
            write_report(args.json, report)
        except OSError as exc:
            raise cli.FixableError(
                f"cannot write the report to {args.json}: {exc}",
                "the report is printed above; "
                + cli.os_error_fix(exc, args.json.parent, "give --json a writable path"),
            ) from None
    return 1 if report.failures else 0


def main(argv: Sequence[str] | None = None) -> int:
    return cli.run(PROG, parse_args, run, argv, terminate_cleanly=True)
