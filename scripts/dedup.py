"""Hardlink identical regular files across directory trees (per-backend venvs).

Why: an image or host prefix holds one venv per EP backend, and each venv carries the same
~5 GB of torch, CUDA libraries and friends. Linking identical files makes N venvs cost about one
on disk and in an image layer, while each venv stays a complete, independent-looking tree.

The finding and linking is util-linux `hardlink` (>= 2.38: Debian 12 ships 2.38, Ubuntu 24.04,
the image's base, 2.39, Debian 13 2.41; util-linux is an essential package in all of them).
It guarantees, and is run so that (``--respect-xattrs --method memcmp --maximize``):
- only regular files are linked; it never follows a symlink;
- files are linked only when their bytes are equal (size, then a byte-for-byte comparison),
  they are on one device, and their mode, owner, group and xattrs are equal;
- each duplicate is replaced atomically: the kept file is linked to
  ``<duplicate>.hardlink-temporary``, which is renamed over the duplicate, so every path holds
  a complete file at every instant;
- of equal files it keeps the inode with the most links, so an inode shared with uv's cache
  (or an earlier run) is the one kept and a copy is the one freed.

What this script adds, because hardlink does not do it (each tested in tests/test_dedup.py):
- all ROOTs must be on one filesystem, else the run is refused before anything changes (exit
  2); hardlink would silently link per device. Directories of another filesystem below a ROOT
  are left out (hardlink 2.38/2.39 have no ``--mount``).
- files that tools rewrite in place are never linked (``pyvenv.cfg``, ``*.pth``, the venv's
  ``bin/activate*``, a dist's ``RECORD``/``INSTALLER``/``REQUESTED``/``direct_url.json``,
  ``ep-backend.json``), passed to hardlink as ``--exclude`` regexes.
- the bytecode rule: hardlink runs with ``--ignore-time``, since copies of one wheel get
  different mtimes. But a timestamp-validated ``.pyc`` is valid only while its source keeps the
  mtime it records, and a shared inode has one mtime. So if any ``.pyc`` under the ROOTs is
  timestamp-validated, ``.py`` files get a second hardlink pass of their own that respects
  mtimes (whole inodes, whichever path holds the ``.pyc``). make_venv.py compiles hash-checked
  ``.pyc`` files, so its venvs never need that pass; pip, uv's UV_COMPILE_BYTECODE and Python
  itself at import write timestamp-validated ones.
- ``--read-only``: every inode shared by two or more paths here loses its write bits, so an
  in-place write into one venv fails (for non-root users) instead of reaching the others.
  Write bits do not keep equal files apart under ``--read-only`` (a venv added later still
  links to the read-only copies): they are cleared before hardlink runs and given back to
  inodes that stayed unshared. Inodes also linked from outside the ROOTs keep their mode.
- a report whose figures are `du`'s: ``du_bytes_before``/``du_bytes_after`` equal
  ``du -sxcB1 ROOT...``, and ``saved_bytes`` is what the filesystem got back (inodes whose last
  link was replaced). Linking a file to an inode that lives on through a link outside the ROOTs
  shares it here but frees nothing; such inodes are reported apart.
- a temporary link left by a killed run (``*.hardlink-temporary`` with two or more links, or
  the old ``.dedup-tmp-*``) is removed by the next run.
- a file that vanishes while it runs is reported, never a traceback: the report is printed and
  written, and the run exits 1 when hardlink stopped early.

The hazard of hardlinked venvs: a write *into* a shared inode changes every venv that links it.
uv and pip never do that (they unlink, then create; docs/host-mode.md). Tools that write into
the file they are given do: ``strip`` (binutils copies over a file with several links instead of
renaming), ``patchelf``, ``echo >>``, editors that write in place. ``--read-only`` turns such a
write into "Permission denied" for other users; root ignores missing write bits.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import dedup_tree  # sibling module: scripts/ is not a package
from dedup_tree import WRITE_BITS, Tree

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
HARDLINK_MIN_VERSION = (2, 38)
#: The two passes of the bytecode rule: everything but .py files, then only .py files.
_PY = r"\.py$"
_NOT_PY = r"([^.]..|.[^p].|..[^y])$"
_LINK_LINE = re.compile(r"^(?:\[DryRun\] )?(?:Ref)?Linking (?P<pair>.*) \(-[^()]*\)$")
_SUMMARY = re.compile(r"^Linked:\s+(\d+) files")


class DedupError(Exception):
    """A reason to refuse the whole run before anything changes (exit code 2)."""


@dataclass
class Report:
    """What a run did, printed and optionally written as JSON (``--json``)."""

    roots: list[str]
    device: int
    dry_run: bool
    read_only: bool
    tool: str = ""
    commands: list[list[str]] = field(default_factory=list)
    timestamp_pyc: str | None = None  # set: the bytecode rule's .py pass ran (first such .pyc)
    files_scanned: int = 0
    inodes_before: int = 0
    bytes_before: int = 0  # apparent size under the ROOTs, each inode once
    bytes_after: int = 0
    du_bytes_before: int = 0  # `du -sxcB1 ROOT...`
    du_bytes_after: int = 0
    saved_bytes: int = 0  # what the filesystem got back
    shared_not_freed_bytes: int = 0  # merged here, alive through links outside the ROOTs
    files_linked: int = 0
    inodes_merged: int = 0
    files_made_read_only: int = 0
    stale_temps_removed: int = 0
    seconds: float = 0.0
    skipped: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- the tool


def find_hardlink() -> tuple[str, str]:
    """Path and version line of util-linux hardlink >= 2.38, else DedupError naming the fix."""
    path = shutil.which("hardlink")
    fix = (
        "install util-linux >= 2.38 (Debian 12+, Ubuntu 24.04+: `apt-get install util-linux`; "
        "it is an essential package there, so it is normally present)"
    )
    if path is None:
        raise DedupError(f"`hardlink` is not on PATH: {fix}")
    out = subprocess.run(
        [path, "--version"], capture_output=True, text=True, env=_c_locale(), check=False
    ).stdout.strip()
    match = re.search(r"util-linux (\d+)\.(\d+)", out)
    if not match or (int(match[1]), int(match[2])) < HARDLINK_MIN_VERSION:
        raise DedupError(f"{path} says {out!r}, not util-linux hardlink >= 2.38: {fix}")
    return path, out


def _c_locale() -> dict[str, str]:
    """hardlink translates its messages; the parser reads the untranslated ones."""
    return {**os.environ, "LC_ALL": "C"}


@dataclass
class ToolRun:
    """One hardlink invocation, parsed."""

    argv: list[str]
    pairs: list[tuple[str, str]]  # (kept path, replaced path), in the order hardlink linked
    linked: int  # files linked (dry run: would link), hardlink's own count
    failures: list[str]


def hardlink_argv(
    binary: str,
    roots: Sequence[Path],
    excludes: Sequence[str],
    *,
    ignore_time: bool,
    dry_run: bool,
    min_size: int,
) -> list[str]:
    """The command line: see the module docstring for why each flag."""
    argv = [binary, "--verbose", "--respect-xattrs", "--maximize", "--method", "memcmp"]
    argv += ["--minimum-size", str(min_size)]
    argv += ["--ignore-time"] if ignore_time else []
    argv += ["--dry-run"] if dry_run else []
    for regex in excludes:
        argv += ["--exclude", regex]
    return [*argv, "--", *map(str, roots)]


def run_hardlink(argv: list[str], *, keep_pairs: bool) -> ToolRun:
    """Run hardlink; its ``Linking A to B`` lines say what it linked (or would link).

    Its output is read line by line and the pairs kept only when asked (a dry run predicts
    the result from them): a real run over two torch venvs prints some 20,000 such lines.
    """
    pairs: list[tuple[str, str]] = []
    lines = linked_lines = 0
    summary: int | None = None
    # surrogateescape: a path that is not UTF-8 comes back as the same bytes for os.lstat.
    with tempfile.TemporaryFile("w+", errors="replace") as errors:
        with subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            errors="surrogateescape",
            env=_c_locale(),
        ) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines += 1
                if match := _LINK_LINE.match(line.rstrip("\n")):
                    linked_lines += 1
                    if keep_pairs and (pair := _split_pair(match["pair"])):
                        pairs.append(pair)
                elif match := _SUMMARY.match(line):
                    summary = int(match[1])
        errors.seek(0)
        failures = [line.rstrip("\n") for line in errors if line.strip()]
    # The summary counts successful links only; a killed hardlink prints none.
    failed = sum("cannot link" in f or "cannot rename" in f for f in failures)
    linked = summary if summary is not None else linked_lines - failed
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        failures.append(
            f"hardlink was killed by {name}: files it had not reached are left as they were; "
            "every path still holds a complete file; run dedup again to finish"
        )
    elif proc.returncode != 0:
        failures.append(
            f"hardlink stopped early with exit code {proc.returncode} (see the lines above): "
            "files it had not reached are left as they were; run dedup again to finish"
        )
    return ToolRun(argv=argv, pairs=pairs, linked=linked, failures=failures)


def _split_pair(text: str) -> tuple[str, str] | None:
    """Split ``A to B`` where the paths may themselves hold " to ": A must exist."""
    start = 0
    while (at := text.find(" to ", start)) != -1:
        if os.path.lexists(text[:at]):
            return text[:at], text[at + 4 :]
        start = at + 1
    return None


# --------------------------------------------------------------------------- roots


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


def is_excluded(relative: str, patterns: Iterable[str]) -> bool:
    """True if ``relative`` (posix, under a root) matches one of the fnmatch ``patterns``."""
    return any(re.search(dedup_tree.glob_to_regex(p), "/" + relative) for p in patterns)


# --------------------------------------------------------------------------- read-only


def drop_write_bits(tree: Tree, report: Report) -> dict[tuple[int, int], int]:
    """--read-only, before linking: clear write bits so they keep no equal files apart.

    Returns inode -> original mode, to give the bits back to inodes that stay unshared.
    Inodes linked from outside the ROOTs are not ours to change and keep their mode.
    """
    changed: dict[tuple[int, int], int] = {}
    for key, inode in tree.files.items():
        writable = inode.candidate and not inode.linked_outside and inode.mode & WRITE_BITS
        if writable and _chmod(inode.path, inode.mode & ~WRITE_BITS, report):
            changed[key] = inode.mode
    return changed


def _chmod(path: str, mode: int, report: Report) -> bool:
    try:
        os.chmod(path, mode, follow_symlinks=False)
    except OSError as exc:
        report.failures.append(f"{path}: cannot change its mode: {exc}")
        return False
    return True


def settle_modes(
    tree: Tree, changed: dict[tuple[int, int], int], report: Report, skipped: Counter[str]
) -> None:
    """--read-only, after linking: shared inodes stay read-only, unshared ones get theirs back."""
    for key, inode in tree.files.items():
        if inode.here < 2 or not inode.candidate:
            if key in changed:
                _chmod(inode.path, changed[key], report)
        elif inode.linked_outside:
            skipped["read-only not applied: also linked from outside the ROOTs"] += inode.here
        elif inode.mode & WRITE_BITS:
            if _chmod(inode.path, inode.mode & ~WRITE_BITS, report):
                report.files_made_read_only += inode.here
        elif key in changed:
            report.files_made_read_only += inode.here


# --------------------------------------------------------------------------- driver


def _predict(before: Tree, pairs: Iterable[tuple[str, str]]) -> Tree:
    """--dry-run: the trees as they would be after hardlink made the links it printed."""
    here = {key: inode.here for key, inode in before.files.items()}
    for kept, replaced in pairs:
        try:
            k, r = os.lstat(kept), os.lstat(replaced)
        except FileNotFoundError:
            continue
        here[(r.st_dev, r.st_ino)] -= 1
        here[(k.st_dev, k.st_ino)] += 1
    after = Tree(other_blocks=before.other_blocks, files_scanned=before.files_scanned)
    for key, inode in before.files.items():
        if here[key] > 0:
            after.files[key] = replace(inode, here=here[key])
    return after


def _account(before: Tree, after: Tree, report: Report) -> None:
    """The report's figures: apparent and du bytes, what was freed, what is only shared."""
    report.bytes_after = after.apparent_bytes()
    report.du_bytes_after = after.du_bytes()
    for key, inode in before.files.items():
        if key in after.files:
            continue
        report.inodes_merged += 1
        if inode.linked_outside:
            report.shared_not_freed_bytes += inode.blocks
        else:
            report.saved_bytes += inode.blocks


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
    binary, version = find_hardlink()
    report = Report(
        roots=[str(p) for p in paths], device=device, dry_run=dry_run, read_only=read_only
    )
    report.tool = version
    regexes = [dedup_tree.glob_to_regex(p) for p in excludes]
    exclude = re.compile("|".join(regexes)) if regexes else None
    skipped: Counter[str] = Counter()

    before = dedup_tree.scan(
        paths, device, exclude, min_size, skipped, find_timestamp_pyc=True, keep_paths=read_only
    )
    for temp in before.stale_temps:
        if dry_run:
            skipped["stale temporary links (removed on a real run)"] += 1
        else:
            try:
                os.unlink(temp)
            except OSError as exc:
                report.failures.append(f"{temp}: cannot remove this leftover link: {exc}")
            else:
                report.stale_temps_removed += 1
    report.files_scanned = before.files_scanned
    report.inodes_before = len(before.files)
    report.bytes_before = before.apparent_bytes()
    report.du_bytes_before = before.du_bytes()
    report.timestamp_pyc = before.timestamp_pyc

    # The passes: one with --ignore-time; under the bytecode rule, .py files apart, by mtime.
    base = regexes + [dedup_tree.literal_regex(d) for d in before.other_filesystems]
    passes = [(True, base)]
    if before.timestamp_pyc:
        passes = [(True, [*base, _PY]), (False, [*base, _NOT_PY])]
    changed = drop_write_bits(before, report) if read_only and not dry_run else {}
    pairs: list[tuple[str, str]] = []
    for ignore_time, regex_list in passes:
        argv = hardlink_argv(
            binary, paths, regex_list, ignore_time=ignore_time, dry_run=dry_run, min_size=min_size
        )
        run = run_hardlink(argv, keep_pairs=dry_run)
        report.commands.append(argv)
        report.failures += run.failures
        report.files_linked += run.linked
        pairs += run.pairs

    if dry_run:
        after = _predict(before, pairs)
    else:
        after = dedup_tree.scan(paths, device, exclude, min_size, Counter(), keep_paths=read_only)
    _account(before, after, report)
    if read_only and not dry_run:
        settle_modes(after, changed, report, skipped)
    report.skipped = dict(skipped)
    report.seconds = round(time.monotonic() - started, 3)
    return report


# --------------------------------------------------------------------------- output


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
    print(f"dedup: roots {' '.join(report.roots)} (device {report.device}), {report.tool}")
    print(f"dedup: {report.files_scanned} regular files, {report.inodes_before} inodes")
    print(f"dedup: {verb} {report.files_linked} files, {report.inodes_merged} inodes merged")
    print(
        f"dedup: du before {report.du_bytes_before} ({human(report.du_bytes_before)}), "
        f"after {report.du_bytes_after} ({human(report.du_bytes_after)}); freed on the "
        f"filesystem {report.saved_bytes} ({human(report.saved_bytes)})"
    )
    if report.shared_not_freed_bytes:
        print(
            f"dedup: {human(report.shared_not_freed_bytes)} merged here freed nothing: those "
            "inodes are also linked from outside the ROOTs (e.g. uv's cache) and stay on disk"
        )
    if report.timestamp_pyc:
        print(
            "dedup: timestamp-validated bytecode (e.g. "
            f"{report.timestamp_pyc}): .py files linked only to ones of equal mtime"
        )
    if report.read_only:
        print(f"dedup: made read-only: {report.files_made_read_only} paths")
    if report.stale_temps_removed:
        print(f"dedup: removed {report.stale_temps_removed} temporary links of a killed run")
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
            "about one. util-linux hardlink links files with equal bytes, mode, owner, group "
            "and xattrs, each duplicate replaced atomically (link to a temporary name, then "
            "rename); this script adds the same-filesystem check, the excludes, the bytecode "
            "rule, --read-only and a report in du's terms. A second run is a no-op."
        ),
        epilog=(
            "Exit codes: 0 done; 1 some files could not be linked or hardlink stopped early "
            "(listed; run again to finish); 2 refused before changing anything (bad ROOT, "
            "ROOTs on different filesystems, no util-linux hardlink >= 2.38). "
            "Example: python scripts/dedup.py --json /tmp/dedup.json /opt/venvs/one "
            "/opt/venvs/two"
        ),
    )
    parser.add_argument("roots", nargs="+", metavar="ROOT", help="a tree to deduplicate")
    parser.add_argument(
        "--dry-run", action="store_true", help="compare everything, report, change nothing"
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
