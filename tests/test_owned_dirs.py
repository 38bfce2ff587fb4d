"""tests/_owned_dirs.py: what a killed run left under the image tests' parent directory goes at
the next run; what a live run owns stays. Real processes, a real SIGKILL and a real mount."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import _owned_dirs as owned_dirs
import pytest
from _mounts import why_not

TESTS = Path(__file__).resolve().parent

#: A run that makes its directory, starts a process that names it, says where, and waits.
OWNER = """
import subprocess, sys, time
import _owned_dirs
owned = _owned_dirs.make(__import__("pathlib").Path(sys.argv[1]), "docker-")
(owned.path / "data").mkdir()
(owned.path / "data" / "layer").write_bytes(b"x" * 4096)
# A daemon of the run, detached as dockerd is (its own session), naming the directory.
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", str(owned.path / "data")],
                 start_new_session=True)
print(owned.path, flush=True)
time.sleep(600)
"""


def start_owner(parent: Path) -> tuple[subprocess.Popen[str], Path]:
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    proc = subprocess.Popen([sys.executable, "-c", OWNER, str(parent)], stdout=subprocess.PIPE,
                            text=True, env=env)  # fmt: skip
    assert proc.stdout is not None
    return proc, Path(proc.stdout.readline().strip())


def test_a_killed_runs_directory_goes_and_a_live_ones_stays(tmp_path: Path) -> None:
    live, live_dir = start_owner(tmp_path)
    dead, dead_dir = start_owner(tmp_path)
    try:
        dead.send_signal(signal.SIGKILL)
        dead.wait()
        daemon = owned_dirs.naming(dead_dir)
        assert len(daemon) == 1, daemon  # its detached process outlived it
        mounted = why_not("bind") is None  # as root: a mount left under it, as netns was
        if mounted:
            (tmp_path / "elsewhere").mkdir()
            (dead_dir / "exec" / "netns").mkdir(parents=True)
            subprocess.run(["mount", "--bind", str(tmp_path / "elsewhere"),
                            str(dead_dir / "exec" / "netns")], check=True)  # fmt: skip
        mine = owned_dirs.make(tmp_path, "docker-")
        assert not dead_dir.exists(), sorted(p.name for p in dead_dir.rglob("*"))
        assert live_dir.is_dir() and (live_dir / "data" / "layer").is_file()
        assert mine.path.is_dir() and mine.path not in (live_dir, dead_dir)
        deadline = time.monotonic() + 15
        while owned_dirs.alive(daemon[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not owned_dirs.alive(daemon[0]), "the dead run's process still runs"
        if mounted:
            assert str(dead_dir) not in Path("/proc/self/mounts").read_text()
            assert (tmp_path / "elsewhere").is_dir()  # the mount's source was left as it was
        mine.release()
        assert owned_dirs.sweep(tmp_path, "docker-") == [mine.path]  # released: swept too
    finally:
        for proc in (live, dead):
            proc.kill()
            proc.wait()
        for path in (live_dir, dead_dir):
            for pid in owned_dirs.naming(path):
                os.kill(pid, signal.SIGKILL)
        if str(dead_dir) in Path("/proc/self/mounts").read_text():
            subprocess.run(["umount", "-l", str(dead_dir / "exec" / "netns")], check=False)
    owned_dirs.sweep(tmp_path, "docker-")
    assert not live_dir.exists()  # its run is gone now


def test_a_directory_without_a_lock_file_is_left_alone(tmp_path: Path) -> None:
    """Made by another tool, or by a run between mkdtemp and its lock: not ours to judge."""
    other = tmp_path / "docker-other"
    other.mkdir()
    (other / "file").write_text("kept")
    assert owned_dirs.sweep(tmp_path, "docker-") == []
    assert (other / "file").read_text() == "kept"


@pytest.mark.parametrize("prefix", ["docker-", "store-"])
def test_only_the_prefix_is_swept(tmp_path: Path, prefix: str) -> None:
    owned = owned_dirs.make(tmp_path, prefix)
    owned.release()
    kept = owned_dirs.make(tmp_path, "other-")
    kept.release()
    assert owned_dirs.sweep(tmp_path, prefix) == [owned.path]
    assert kept.path.is_dir()
