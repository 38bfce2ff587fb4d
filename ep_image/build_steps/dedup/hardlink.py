"""util-linux ``hardlink``, driven: the binary found and checked, its command line, its output read.

Why a module of its own: dedup trusts the tool with finding and linking, and reads back what it
did from its ``Linking A to B`` records, whose names hardlink prints raw (a name may hold a
newline, or " to "). docs/host-mode.md, "Deduplicating venvs", says why each flag.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ep_image.build_steps.dedup.tree import DedupError

HARDLINK_MIN_VERSION = (2, 38)
#: hardlink -v prints "[DryRun] Linking KEPT to REPLACED (-SIZE)" per link, names raw.
_RECORD_START = re.compile(r"^(?:\[DryRun\] )?(?:Ref)?Linking ")
_RECORD = re.compile(r"^(?:\[DryRun\] )?(?:Ref)?Linking (?P<pair>.*) \(-[^()\n]*\)$", re.S)
_SUMMARY_LINE = re.compile(
    r"^(?:Mode|Method|Files|Linked|Compared|Skipped reflinks|Saved|Duration):"
)


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
    returncode: int = 0


def hardlink_argv(
    binary: str,
    roots: Sequence[Path],
    excludes: Sequence[str],
    *,
    ignore_time: bool,
    dry_run: bool,
    min_size: int,
    respect_xattrs: bool = True,
) -> list[str]:
    """The command line: docs/host-mode.md, "Deduplicating venvs", says why each flag.
    ``respect_xattrs`` off only where dedup compared them itself (overlayfs, overlay.py)."""
    argv = [binary, "--verbose", *(["--respect-xattrs"] if respect_xattrs else [])]
    argv += ["--maximize", "--method", "memcmp"]
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
        if -proc.returncode in (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL):
            failures.append(
                f"hardlink crashed ({name}; its own message is above): files it had not reached "
                "are left as they were and every path still holds a complete file, but running "
                "dedup again meets the same crash: report it with the lines above"
            )
        else:
            failures.append(
                f"hardlink was killed by {name}: files it had not reached are left as they "
                "were; every path still holds a complete file; run dedup again to finish"
            )
    elif proc.returncode != 0:
        failures.append(
            f"hardlink stopped early with exit code {proc.returncode} (see the lines above): "
            "files it had not reached are left as they were; run dedup again to finish"
        )
    return ToolRun(argv=argv, pairs=pairs, failures=failures, returncode=proc.returncode)


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
