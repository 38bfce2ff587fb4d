#!/usr/bin/env python3
"""Paths and names of the machine a run happened on, found in (and taken out of) committed files.

Why: a dated run under evidence/ is kept so that anyone can read and rerun it; the checkout's
directory, a home, a temporary directory's random name, a GPU's UUID or a kernel's build string
say where it ran, not what it showed, and they differ on the next machine. The data keeps its
meaning with a neutral placeholder in their place (the placeholders are listed in
evidence/README.md, "Placeholders"). tests/test_machine_paths.py holds README.md, docs/ and
evidence/ free of them; this file is also the command that makes a new run's data so:

    python3 tests/machine_paths.py evidence/2026-12-05        # list what it finds
    python3 tests/machine_paths.py --fix evidence/2026-12-05  # replace it in the data files

``--fix`` rewrites data files only (reports, logs, listings): the run's own scripts and page are
written by hand and name their working directories on purpose.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: A path is one when nothing path-like stands right before it (``/var/tmp/`` is not ``/tmp/``).
_START = r"(?<![\w.~<>-])"

#: (what it is, pattern): never in a committed file under README.md, docs/ or evidence/.
MACHINE: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("a checkout or work directory of the machine", re.compile(_START + r"/work/")),
    ("a user's home directory", re.compile(_START + r"(?:/root/|/home/[^/\s]+/)")),
    ("pytest's temporary directory", re.compile(_START + r"/tmp/pytest-of-")),
    ("a GPU's UUID", re.compile(r"\b(?:GPU|MIG)-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-")),
    ("a kernel's build string", re.compile(r"(?i)\bkernel\W{0,4}\s*\d+\.\d+\.\d+-[\w.+~]")),
)  # fmt: skip

#: Also never in a data file of a dated run (anything but its page and its scripts): the
#: machine's temporary directory. Scripts and pages name the directories they chose.
DATA_ONLY: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("the machine's temporary directory", re.compile(_START + r"/tmp/")),
)

#: Paths the product itself names, which hold the same meaning on every machine: the image's uv
#: cache (docker/Dockerfile's UV_CACHE_DIR, kept in the image records' config).
ALLOWED: tuple[str, ...] = ("/root/.cache/uv",)

#: Hand-written files of a dated run: its page and its scripts.
HAND_WRITTEN = {".md", ".sh", ".py"}

#: How ``--fix`` neutralises each, in order (the first that matches a spot wins).
REPLACEMENTS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(_START + r"/work/main(?=[/\s\"':,)\]]|$)"), "<repo>"),
    (re.compile(_START + r"/work/"), "<work>/"),
    (re.compile(_START + r"/tmp/pytest-of-[^/\s\"']+/pytest-\d+/"), "<pytest-tmp>/"),
    (re.compile(_START + r"/root/(?!\.cache/uv\b)"), "~/"),
    (re.compile(_START + r"/home/[^/\s\"']+/"), "~/"),
    (re.compile(r"\b(GPU|MIG)-[0-9a-fA-F]{8}(?:-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}\b"),
     r"\1-<uuid>"),
    (re.compile(r"(?i)(\bkernel\W{0,4}\s*\d+\.\d+\.\d+)-[\w.+~-]+"), r"\1-<build>"),
    (re.compile(_START + r"/tmp/"), "<tmp>/"),
)  # fmt: skip


@dataclass(frozen=True)
class Finding:
    """One machine path in one file."""

    path: Path
    line: int
    what: str
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}: {self.text.strip()[:160]}"


def is_data(path: Path) -> bool:
    """A data file of a dated run (not its page or a script)."""
    return path.suffix not in HAND_WRITTEN


def patterns_for(path: Path) -> tuple[tuple[str, re.Pattern[str]], ...]:
    return MACHINE + (DATA_ONLY if is_data(path) else ())


def _masked(line: str) -> str:
    """``line`` with the allowed paths blanked (same length, so positions hold)."""
    for allowed in ALLOWED:
        line = line.replace(allowed, "#" * len(allowed))
    return line


def find(path: Path, text: str | None = None) -> list[Finding]:
    """Every machine path in ``path`` (its text may be given)."""
    if text is None:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            return []
    found = []
    checks = patterns_for(path)
    for number, line in enumerate(text.splitlines(), 1):
        masked = _masked(line)
        for what, pattern in checks:
            if pattern.search(masked):
                found.append(Finding(path, number, what, line))
    return found


def neutral(text: str) -> str:
    """``text`` with every machine path replaced by its placeholder (allowed paths kept)."""
    out = []
    for line in text.splitlines(keepends=True):
        for pattern, placeholder in REPLACEMENTS:
            line = pattern.sub(placeholder, line)
        out.append(line)
    return "".join(out)


def files_under(paths: Iterable[Path]) -> Iterator[Path]:
    for path in paths:
        if path.is_dir():
            yield from sorted(p for p in path.rglob("*") if p.is_file())
        elif path.is_file():
            yield path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="machine_paths.py",
        description="List (or with --fix replace) paths of the machine a run happened on: "
        "work and temporary directories, homes, GPU UUIDs, kernel build strings.",
    )
    parser.add_argument("paths", nargs="+", type=Path, help="files or directories to check")
    parser.add_argument(
        "--fix", action="store_true", help="replace them with placeholders in the data files"
    )
    args = parser.parse_args(argv)
    left = 0
    for path in files_under(args.paths):
        if args.fix and is_data(path) and find(path):
            path.write_text(neutral(path.read_text(encoding="utf-8")), encoding="utf-8")
        for finding in find(path):
            print(finding)
            left += 1
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
