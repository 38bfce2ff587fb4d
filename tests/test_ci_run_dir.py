""".ci/run-dir: what a killed .ci/run left is removed by the next one, a live run's
directory is not.

A CI run killed mid-way left its directory in the cache (pytest's temporary files, buildah
storage): 15 GB, found by the next session. Played here with real processes: a run alive (a
shell that owns its directory), one killed (its owner gone), one whose PID is alive but is
another process (the PID reused), one from before owners.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN_DIR = ROOT / ".ci" / "run-dir"


def a_run(cache: Path, name: str) -> tuple[Path, subprocess.Popen]:
    """A run's directory, owned by a live shell as .ci/run owns its own."""
    run_dir = cache / f"ci-run.{name}"
    (run_dir / "pytest-of-root").mkdir(parents=True)
    (run_dir / "pytest-of-root" / "build.log").write_text("left behind\n")
    own = f'"{RUN_DIR}" own "$1" $$; exec sleep 300'
    shell = subprocess.Popen(["bash", "-c", own, "run", str(run_dir)])
    deadline = time.monotonic() + 10
    while not (run_dir / "owner").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return run_dir, shell


def test_a_killed_runs_directory_goes_a_live_ones_stays(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    alive, alive_shell = a_run(cache, "alive")
    killed, killed_shell = a_run(cache, "killed")
    reused, reused_shell = a_run(cache, "reused")
    old = cache / "ci-run.old"  # from before owners, an hour old
    old.mkdir()
    hour_ago = time.time() - 3600
    os.utime(old, (hour_ago, hour_ago))
    fresh = cache / "ci-run.fresh"  # just made, no owner yet
    fresh.mkdir()
    try:
        killed_shell.send_signal(signal.SIGKILL)
        killed_shell.wait()
        # The PID of a live process that is not the run: another start time.
        pid, _ = (reused / "owner").read_text().split()
        (reused / "owner").write_text(f"{pid} 1\n")
        own = cache / "ci-run.own"
        own.mkdir()
        proc = subprocess.run(
            [str(RUN_DIR), "sweep", str(cache), str(own)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        for shell in (alive_shell, reused_shell):
            shell.kill()
            shell.wait()
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in cache.iterdir()) == [
        "ci-run.alive", "ci-run.fresh", "ci-run.own"
    ], proc.stdout  # fmt: skip
    assert (alive / "pytest-of-root" / "build.log").is_file()
    for gone in (killed, reused, old):
        assert f"removed {gone} (" in proc.stdout, proc.stdout


def test_ci_run_owns_its_directory_and_sweeps_before_the_tests() -> None:
    text = (ROOT / ".ci" / "run").read_text()
    owner, sweep = text.index('own "$run_dir" $$'), text.index('sweep "$cache" "$run_dir"')
    assert owner < sweep < text.index("uv run --exact"), "own, then sweep, then the tests"
