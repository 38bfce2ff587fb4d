"""After a failed run, keep what a failure needs for debugging, bounded, and say where.

Why: pytest keeps a failed session's whole base temporary directory, and session fixtures here
build whole venvs (GBs each): one failed run once left 11 GB in /tmp/pytest-of-root. Logs,
reports and small trees are what a failure is debugged from; a venv or a large file is
rebuilt by running the test again. Loaded by conftest.py (and by ``-p`` in its own test).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import pytest

#: A regular file at least this large is removed from what a failed run keeps.
LARGE_FILE = 64 << 20


def _prune(tree: Path) -> tuple[int, int]:
    """Remove every venv (a directory holding ``pyvenv.cfg``) and every large file under
    ``tree``; the (venvs, files) removed. Symbolic links are never followed."""
    venvs = files = 0
    for dirpath, dirnames, filenames in os.walk(tree):
        here = Path(dirpath)
        if "pyvenv.cfg" in filenames:
            shutil.rmtree(here, ignore_errors=True)
            (here.parent / f"{here.name}.removed").write_text(
                "a venv, removed after the failed run (run the test again to rebuild it)\n"
            )
            dirnames[:] = []
            venvs += 1
            continue
        for name in filenames:
            path = here / name
            if not path.is_symlink() and path.is_file() and path.stat().st_size >= LARGE_FILE:
                path.unlink()
                files += 1
    return venvs, files


def _size(tree: Path) -> int:
    total = 0
    for dirpath, _, filenames in os.walk(tree):
        for name in filenames:
            with contextlib.suppress(OSError):  # removed while we walk
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config
) -> None:
    factory = getattr(config, "_tmp_path_factory", None)
    basetemp = getattr(factory, "_basetemp", None)
    if exitstatus == 0 or basetemp is None or not Path(basetemp).is_dir():
        return  # a passing session's directory is removed by pytest itself
    venvs, files = _prune(Path(basetemp))
    terminalreporter.write_line(
        f"kept for debugging: {basetemp} ({_size(Path(basetemp)) / 2**20:.0f} MiB; removed "
        f"{venvs} venvs and {files} files over {LARGE_FILE >> 20} MiB; the failed tests' "
        "directories are named after them)"
    )
