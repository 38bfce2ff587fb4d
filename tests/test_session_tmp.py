"""A test run's children write their temporary files into one directory, removed at the end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

INNER = """
import os, subprocess, sys, tempfile

def test_children_write_temporary_files(tmp_path):
    # What torchrun and uv leave behind: a torchelastic_* directory, a uv-*.lock file.
    subprocess.run([sys.executable, "-c",
        "import tempfile, os; d = tempfile.mkdtemp(prefix='torchelastic_'); "
        "open(os.path.join(tempfile.gettempdir(), 'uv-0123.lock'), 'w').close()"], check=True)
    (tmp_path / "kept.log").write_text("pytest's own directory")
    assert {FAIL}
"""


def run_inner(tmp_path: Path, fail: bool) -> tuple[subprocess.CompletedProcess[str], Path]:
    (tmp_path / "test_inner.py").write_text(INNER.replace("{FAIL}", "False" if fail else "True"))
    machine_tmp = tmp_path / "tmp"
    machine_tmp.mkdir()
    env = {**os.environ, "PYTHONPATH": str(TESTS), "TMPDIR": str(machine_tmp)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "_session_tmp", "-p", "no:cacheprovider",
         "test_inner.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return proc, machine_tmp


def test_a_run_leaves_nothing_of_its_children_in_the_temporary_directory(tmp_path: Path) -> None:
    for fail in (False, True):
        case = tmp_path / ("failing" if fail else "passing")
        case.mkdir()
        proc, machine_tmp = run_inner(case, fail)
        assert proc.returncode == (1 if fail else 0), proc.stdout + proc.stderr
        left = sorted(p.name for p in machine_tmp.iterdir())
        # Only pytest's own base directory (kept after a failure for debugging) may remain.
        assert all(name.startswith("pytest-of-") for name in left), left
        assert not list(machine_tmp.rglob("torchelastic_*")), left
        assert not list(machine_tmp.rglob("uv-*.lock")), left


def test_this_run_hands_its_children_a_temporary_directory_of_its_own() -> None:
    tmpdir = Path(os.environ["TMPDIR"])
    assert tmpdir.name.startswith("ep-image-tests-") and tmpdir.is_dir()
