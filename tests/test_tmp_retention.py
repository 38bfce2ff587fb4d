"""A failed run keeps its tests' logs and small files, not their venvs, and says where."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

FAILING = """
def test_fails(tmp_path):
    venv = tmp_path / "venv"
    (venv / "lib").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\\n")
    (venv / "lib" / "libbig.so").write_bytes(b"x" * 4096)
    with open(tmp_path / "big.bin", "wb") as f:
        f.truncate(65 << 20)  # sparse: large by size, costs no disk
    (tmp_path / "build.log").write_text("what the failure needs\\n")
    assert False
"""


def test_a_failed_run_keeps_its_logs_drops_its_venvs_and_says_where(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(FAILING)
    (tmp_path / "pytest.ini").write_text("[pytest]\ntmp_path_retention_policy = failed\n")
    env = {**os.environ, "PYTHONPATH": str(TESTS), "TMPDIR": str(tmp_path / "tmp")}
    (tmp_path / "tmp").mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "_tmp_retention", "-p", "no:cacheprovider",
         "test_inner.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    said = re.search(r"kept for debugging: (\S+) \(", proc.stdout)
    assert said, proc.stdout
    kept = Path(said.group(1))
    test_dir = next(kept.glob("test_fails*"))
    assert (test_dir / "build.log").read_text() == "what the failure needs\n"
    assert not (test_dir / "venv").exists() and (test_dir / "venv.removed").is_file()
    assert not (test_dir / "big.bin").exists()
    assert "removed 1 venvs and 1 files" in proc.stdout
