"""What a user sees of a failure and of a long step in a run's log: each on a line of its own.

A worker's progress line once landed inside the controller's line of dots (the F marks after
it), and a failure was named only in the summary, at the end of a 25-minute run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

INNER = """
import pytest
from _progress import Progress

def test_passes_first():
    pass

def test_long_step(request):
    with Progress(request.config, "long step") as p:
        p.say("halfway")

def test_fails():
    assert False, "the reason"

def test_passes_after():
    pass
"""


def run_inner(tmp_path: Path, *args: str) -> str:
    (tmp_path / "test_inner.py").write_text(INNER)
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "_progress", "-p", "no:cacheprovider",
         "-o", "addopts=", *args, "test_inner.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def test_a_failure_is_named_on_its_own_line_as_it_happens(tmp_path: Path) -> None:
    out = run_inner(tmp_path)
    line = "FAILED test_inner.py::test_fails: its traceback follows at the end"
    lines = out.splitlines()
    assert line in lines, out
    assert lines.index(line) < next(i for i, s in enumerate(lines) if "= FAILURES =" in s), out


def test_a_progress_line_starts_a_line_of_its_own(tmp_path: Path) -> None:
    out = run_inner(tmp_path, "-s")
    progress = [s for s in out.splitlines() if "[long step]" in s]
    assert [s.split(": ", 1)[1] for s in progress] == ["started", "halfway", "done"], out
    assert all(s.startswith("  [long step]") for s in progress), progress


def test_under_xdist_the_controller_names_the_failure_once(tmp_path: Path) -> None:
    out = run_inner(tmp_path, "-n", "2")
    named = [s for s in out.splitlines() if s.startswith("FAILED test_inner.py::test_fails:")]
    assert len(named) == 1, out
