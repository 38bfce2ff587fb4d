"""Hardlink identical regular files across directory trees (per-backend venvs).

N venvs that carry the same torch and CUDA libraries then cost about one. util-linux
``hardlink`` finds and links; this script adds what it does not guarantee: one filesystem, the
excludes, the bytecode rule, ``--read-only`` and a report in ``du``'s terms. See
docs/host-mode.md, sections "Deduplicating venvs" and "Hardlinked venvs and installers".
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ep_image.build_steps import dedup_tree
from ep_image.build_steps.dedup_tree import MODES_JOURNAL, WRITE_BITS, Tree

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
#: hardlink -v prints "[DryRun] Linking KEPT to REPLACED (-SIZE)" per link, names raw.
_RECORD_START = re.compile(r"^(?:\[DryRun\] )?(?:Ref)?Linking ")
_RECORD = re.compile(r"^(?:\[DryRun\] )?(?:Ref)?Linking (?P<pair>.*) \(-[^()\n]*\)$", re.S)
_SUMMARY_LINE = re.compile(
    r"^(?:Mode|Method|Files|Linked|Compared|Skipped reflinks|Saved|Duration):"
)
#: --read-only's --exclude regexes (the copies also linked from outside) may not pass this:
#: a command line holds about 2 MiB in all.
EXCLUDE_REGEX_LIMIT = 1 << 20
_HEAD = 4096


class DedupError(Exception):
    """A reason to refuse the whole run before anything changes (exit code 2).

    ``fix`` is what the user does about it; it is printed as the last line.
    """

    def __init__(self, reason: str, fix: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.fix = fix


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
    files_linked: int = 0  # paths that now hold another inode's data (read back after the run)
    inodes_merged: int = 0
    files_made_read_only: int = 0
    modes_restored: int = 0  # write bits a killed --read-only run had cleared, given back
    stale_temps_removed: int = 0
    seconds: float = 0.0
    skipped: dict[str, int] = field(default_factory=dict)  # not linked, and why
    left_writable: dict[str, int] = field(default_factory=dict)  # --read-only: not applied, why
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
        raise DedupError("`hardlink` is not on PATH", fix)
    out = subprocess.run(
        [path, "--version"], capture_output=True, text=True, env=_c_locale(), check=False
    ).stdout.strip()
    match = re.search(r"util-linux (\d+)\.(\d+)", out)
    if not match or (int(match[1]), int(match[2])) < HARDLINK_MIN_VERSION:
        raise DedupError(f"{path} says {out!r}, not util-linux hardlink >= 2.38", fix)
    return path, out


def _c_locale() -> dict[str, str]:
    """hardlink translates its messages; the parser reads the untranslated ones."""
    return {**os.environ, "LC_ALL": "C"}


@dataclass
class ToolRun:
    """One hardlink invocation, parsed."""

    argv: list[str]
    pairs: list[tuple[str, str]]  # (kept path, replaced path), in the order hardlink linked
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


def run_hardlink(argv: list[str]) -> ToolRun:
    """Run hardlink; its ``Linking A to B`` records say what it linked (or would link).

    Its output is read as bytes and split at newlines only, since hardlink prints names raw: a
    name may hold a newline (or a carriage return), so one record may span several lines.
    """
    with tempfile.TemporaryFile("w+", errors="replace") as errors:
        with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=errors, env=_c_locale()) as proc:
            assert proc.stdout is not None
            pairs = parse_link_records(os.fsdecode(line.rstrip(b"\n")) for line in proc.stdout)
        errors.seek(0)
        failures = [line.rstrip("\n") for line in errors if line.strip()]
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
    return ToolRun(argv=argv, pairs=pairs, failures=failures)


def parse_link_records(lines: Iterable[str]) -> list[tuple[str, str]]:
    """(kept, replaced) of each ``Linking`` record; a record ends where its paths exist.

    A line that starts a record or the summary closes an unfinished one, which is dropped (its
    file is gone: nothing to count).
    """
    pairs: list[tuple[str, str]] = []
    record: str | None = None
    for line in lines:
        starts = _RECORD_START.match(line) is not None
        if record is not None and (starts or _SUMMARY_LINE.match(line)):
            record = None
        if record is None:
            if not starts:
                continue
            record = line
        else:
            record += "\n" + line
        match = _RECORD.match(record)
        if match and (pair := _split_pair(match["pair"])):
            pairs.append(pair)
            record = None
    return pairs


def _split_pair(text: str) -> tuple[str, str] | None:
    """Split ``A to B`` where the paths may themselves hold " to ": the split where both exist
    (after a link both do), else the first where A exists."""
    first: tuple[str, str] | None = None
    start = 0
    while (at := text.find(" to ", start)) != -1:
        kept, replaced = text[:at], text[at + 4 :]
        if os.path.lexists(kept):
            if os.path.lexists(replaced):
                return kept, replaced
            first = first or (kept, replaced)
        start = at + 1
    return first


# --------------------------------------------------------------------------- roots


def resolve_roots(roots: Iterable[str | Path]) -> tuple[list[Path], int]:
    """Absolute, existing, non-nested roots on one device; DedupError otherwise."""
    resolved: list[Path] = []
    for root in roots:
        path = Path(root).resolve()
        if not path.is_dir():
            raise DedupError(
                f"{root}: not a directory", "give each ROOT as an existing directory tree"
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
    kept = [p for p in sorted(set(resolved)) if not any(q in p.parents for q in resolved)]
    return kept, devices[resolved[0]]


def is_excluded(relative: str, patterns: Iterable[str]) -> bool:
    """True if ``relative`` (posix, under a root) matches one of the fnmatch ``patterns``."""
    return any(re.search(dedup_tree.glob_to_regex(p), "/" + relative) for p in patterns)


# --------------------------------------------------------------------------- read-only


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
    """--read-only: the inodes whose write bits are cleared before hardlink runs, with their
    modes. Inodes also linked from outside the ROOTs are not ours to change."""
    return {
        key: inode.mode
        for key, inode in tree.files.items()
        if inode.candidate and not inode.linked_outside and inode.mode & WRITE_BITS
    }


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
            "run of python3 -m ep_image.build_steps.dedup on this ROOT gives them back and removes "
            "this file",
            "modes": modes,
        }
        journal = root / MODES_JOURNAL
        temp = root / (MODES_JOURNAL + ".tmp")
        try:
            with open(temp, "w", encoding="utf-8") as handle:
                json.dump(record, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temp, journal)
        except OSError as exc:
            temp.unlink(missing_ok=True)
            raise DedupError(
                f"cannot write {journal}, where --read-only records the modes it clears so "
                f"that a killed run can be undone ({exc}). Nothing was changed.",
                "run dedup as the owner of the trees (it needs to write into each ROOT), or "
                "without --read-only",
            ) from None


def restore_journals(roots: Sequence[Path], report: Report, *, dry_run: bool) -> None:
    """Give back the modes a killed --read-only run cleared (its journals), then drop them.

    A mode is given back only where the file is still the inode the journal names and still
    has the mode the run left (its write bits cleared, nothing else changed since).
    """
    for root in roots:
        journal = root / MODES_JOURNAL
        if not dry_run:  # a run killed while writing its journal had cleared nothing yet
            (root / (MODES_JOURNAL + ".tmp")).unlink(missing_ok=True)
        try:
            modes = json.loads(journal.read_text(encoding="utf-8"))["modes"]
        except FileNotFoundError:
            continue
        except (OSError, ValueError, KeyError, TypeError) as exc:
            report.failures.append(
                f"{journal}: cannot read this journal of a killed --read-only run ({exc}); "
                "files it lists may stay read-only: check their modes, then remove it"
            )
            continue
        for relative, dev, ino, mode in modes:
            path = os.path.join(root, relative)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            same = (st.st_dev, st.st_ino) == (dev, ino) and stat.S_ISREG(st.st_mode)
            as_left = stat.S_IMODE(st.st_mode) == mode & ~WRITE_BITS != mode
            if same and as_left and (dry_run or _chmod(path, mode, report)):
                report.modes_restored += 1
        if not dry_run:
            journal.unlink(missing_ok=True)


def drop_journals(roots: Sequence[Path]) -> None:
    for root in roots:
        (root / MODES_JOURNAL).unlink(missing_ok=True)
        (root / (MODES_JOURNAL + ".tmp")).unlink(missing_ok=True)


def keep_apart(tree: Tree, clear: dict[tuple[int, int], int]) -> list[str]:
    """--read-only: the paths of inodes also linked from outside the ROOTs that have a copy
    here hardlink could link them with; dedup passes them to hardlink as excludes.

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


def _head(path: str) -> str:
    """A digest of the first 4 KiB (the path itself where it cannot be read: never equal)."""
    try:
        with open(path, "rb") as handle:
            return hashlib.sha256(handle.read(_HEAD)).hexdigest()
    except OSError:
        return "unreadable:" + path


def settle_modes(tree: Tree, changed: dict[tuple[int, int], int], report: Report) -> None:
    """--read-only, after linking: shared inodes stay read-only, unshared ones get theirs back;
    inodes also linked from outside keep theirs (reported as left writable)."""
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


# --------------------------------------------------------------------------- driver


def linked_pairs(pairs: Iterable[tuple[str, str]], before: Tree) -> Iterator[tuple[str, str]]:
    """The pairs whose replaced path now holds the kept path's inode, another than before."""
    for kept, replaced in pairs:
        try:
            k, r = os.lstat(kept), os.lstat(replaced)
        except OSError:
            continue
        now = (r.st_dev, r.st_ino)
        if (k.st_dev, k.st_ino) == now and before.index.get(replaced) != now:
            yield kept, replaced


def _predict(before: Tree, pairs: Iterable[tuple[str, str]]) -> Tree:
    """--dry-run: the trees as they would be after hardlink made the links it printed."""
    here = {key: inode.here for key, inode in before.files.items()}
    for kept, replaced in pairs:
        k, r = before.index.get(kept), before.index.get(replaced)
        if k is None or r is None:
            continue
        here[r] -= 1
        here[k] += 1
    after = Tree(other_blocks=before.other_blocks, files_scanned=before.files_scanned)
    for key, inode in before.files.items():
        if here[key] > 0:
            after.files[key] = replace(inode, here=here[key])
    return after


def _account(before: Tree, after: Tree, replaced: set[tuple[int, int]], report: Report) -> None:
    """The report's figures: apparent and du bytes, what was freed, what is only shared.

    An inode that is gone counts as merged only if one of its paths was replaced by a link;
    one that is gone otherwise was removed by someone else while dedup ran.
    """
    report.bytes_after = after.apparent_bytes()
    report.du_bytes_after = after.du_bytes()
    for key, inode in before.files.items():
        if key in after.files:
            continue
        if key not in replaced:
            reason = "removed by another process while dedup ran (not counted as saved)"
            report.skipped[reason] = report.skipped.get(reason, 0) + inode.here
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
    regexes += [dedup_tree.literal_regex(str(p / MODES_JOURNAL)) for p in paths]
    exclude = re.compile("|".join(regexes))
    skipped: Counter[str] = Counter()

    # A killed --read-only run's journals first: the walk below must see the modes as they were.
    restore_journals(paths, report, dry_run=dry_run)
    before = dedup_tree.scan(
        paths,
        device,
        exclude,
        min_size,
        skipped,
        find_timestamp_pyc=True,
        keep_paths=read_only,
        index_paths=True,
    )
    clear = to_clear(before) if read_only else {}
    apart = keep_apart(before, clear) if read_only else []
    if dry_run:
        clear = {}  # nothing is changed; the excludes above are the real run's
    apart_regexes = dedup_tree.paths_regexes(apart)
    if sum(map(len, apart_regexes)) > EXCLUDE_REGEX_LIMIT:
        raise DedupError(
            f"{len(apart)} files here are also linked from outside the ROOTs and have copies "
            "here; --read-only cannot make them read-only and cannot keep that many apart "
            "(hardlink takes them as --exclude arguments). Nothing was changed.",
            "rebuild the venvs with UV_LINK_MODE=copy (as build_host.sh does), or run without "
            "--read-only",
        )
    if apart:
        skipped[
            "also linked from outside the ROOTs: kept apart from their copies (--read-only)"
        ] = len(apart)
    if clear:
        write_journals(before, clear, paths)

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
    base += apart_regexes
    passes = [(True, base)]
    if before.timestamp_pyc:
        passes = [(True, [*base, _PY]), (False, [*base, _NOT_PY])]
    changed = {
        key: mode
        for key, mode in clear.items()
        if _chmod(before.files[key].path, mode & ~WRITE_BITS, report)
    }
    pairs: list[tuple[str, str]] = []
    for ignore_time, regex_list in passes:
        argv = hardlink_argv(
            binary, paths, regex_list, ignore_time=ignore_time, dry_run=dry_run, min_size=min_size
        )
        run = run_hardlink(argv)
        report.commands.append(argv)
        report.failures += run.failures
        pairs += run.pairs

    if dry_run:
        after = _predict(before, pairs)
    else:
        pairs = list(linked_pairs(pairs, before))
        after = dedup_tree.scan(paths, device, exclude, min_size, Counter(), keep_paths=read_only)
    report.files_linked = len(pairs)
    replaced = {before.index[r] for _, r in pairs if r in before.index}
    for root in sorted(set(before.vanished_roots + after.vanished_roots)):
        report.failures.append(
            f"{root}: this ROOT vanished while dedup ran (removed or renamed by another "
            "process); its files are left out of the figures; run dedup again on the trees "
            "that exist"
        )
    _account(before, after, replaced, report)
    if read_only and not dry_run:
        settle_modes(after, changed, report)
        drop_journals(paths)
    for reason, count in skipped.items():
        report.skipped[reason] = report.skipped.get(reason, 0) + count
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
    if report.modes_restored:
        verb = "would give back" if report.dry_run else "gave back"
        print(
            f"dedup: {verb} the write bits of {report.modes_restored} files that a killed "
            "--read-only run had cleared"
        )
    if report.stale_temps_removed:
        print(f"dedup: removed {report.stale_temps_removed} temporary links of a killed run")
    for reason, count in sorted(report.skipped.items()):
        print(f"dedup: not linked: {reason}: {count}")
    for reason, count in sorted(report.left_writable.items()):
        print(f"dedup: left writable (--read-only): {reason}: {count}")
    for failure in report.failures:
        print(f"dedup: FAILED: {failure}", file=sys.stderr)
    print(f"dedup: {report.seconds:.1f} s")
    if report.failures:
        print("dedup: fix: see the FAILED lines; then run dedup again to finish", file=sys.stderr)


def prepare_report_path(path: Path) -> None:
    """--json, before anything changes: its directory exists (made like ``mkdir -p``) and is
    writable, and the path is not a directory; DedupError otherwise."""
    fix = "give --json a file path in a directory you can write"
    if path.is_dir():
        raise DedupError(f"--json {path} is a directory. Nothing was changed.", fix)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DedupError(
            f"--json {path}: cannot make its directory ({exc}). Nothing was changed.", fix
        ) from None
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise DedupError(f"--json {path}: its directory is not writable. Nothing was changed.", fix)


def write_report(path: Path, report: Report) -> None:
    """The JSON report, atomically: a temporary file beside it, renamed over it."""
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(asdict(report), indent=2) + "\n")
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


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
            "Example: python3 -m ep_image.build_steps.dedup --json /tmp/dedup.json /opt/venvs/one "
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


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    excludes = () if args.no_default_excludes else DEFAULT_EXCLUDES
    try:
        if args.json:
            prepare_report_path(args.json)
        report = dedup(
            args.roots,
            dry_run=args.dry_run,
            read_only=args.read_only,
            excludes=excludes + tuple(args.exclude),
            min_size=args.min_size,
        )
    except DedupError as exc:
        print(f"dedup: refused: {exc.reason}", file=sys.stderr)
        print(f"dedup: fix: {exc.fix}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dedup: interrupted: every path still holds a complete file", file=sys.stderr)
        print(
            "dedup: fix: run dedup again to finish (it also gives back write bits an "
            "interrupted --read-only run cleared)",
            file=sys.stderr,
        )
        return 130
    print_report(report)
    if args.json:
        try:
            write_report(args.json, report)
        except OSError as exc:
            print(f"dedup: cannot write the report to {args.json}: {exc}", file=sys.stderr)
            print(
                "dedup: fix: the report is printed above; give --json a writable path",
                file=sys.stderr,
            )
            return 1
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
