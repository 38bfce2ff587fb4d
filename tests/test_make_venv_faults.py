"""ep_image/build_steps/make_venv.py when the user's machine gets in the way: one line naming the
fix, no traceback, nothing half-built left, and never a second build deleting the first one's
work.

Real processes: a prefix that is a file, one this user may not write (make_venv run as nobody),
Ctrl-C (SIGINT to the process group, as a terminal sends it) in the middle of a real build,
leftovers of a build killed during its final rename, and two builds of one venv into one prefix.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from test_make_venv import leftovers, make_venv
from test_source_build import fake_cuda

MAKE_VENV = "ep_image.build_steps.make_venv"


def no_traceback(proc: subprocess.CompletedProcess) -> None:
    """No traceback; the error names its fix, and the last line says where that is."""
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "Fix:" in proc.stderr or "interrupted" in last, proc.stderr
    assert "fix" in last.lower() or "interrupted" in last, last


def test_a_prefix_that_is_a_file_is_named(tmp_path: Path) -> None:
    prefix = tmp_path / "venvs"
    prefix.write_text("not a directory\n")
    proc = make_venv("--backend", "deepep_v2", "--prefix", prefix)
    assert proc.returncode == 1
    assert f"--prefix {prefix} is a file" in proc.stderr
    no_traceback(proc)


@pytest.mark.skipif(os.geteuid() != 0, reason="switches to the user nobody (needs root)")
def test_a_prefix_this_user_cannot_write_is_named(request: pytest.FixtureRequest) -> None:
    """As an unprivileged user: a prefix under a root-owned directory, and an existing one."""
    python = "/usr/bin/python3"  # the system's: nobody may run it (not the test venv's)
    if not Path(python).is_file():
        pytest.skip("no system python3 for the user nobody")
    # Outside pytest's own directories, which only root may enter.
    locked = Path(tempfile.mkdtemp(prefix="ep-nobody-", dir="/tmp"))
    locked.chmod(0o755)
    request.addfinalizer(lambda: shutil.rmtree(locked, ignore_errors=True))

    def as_nobody() -> None:
        os.setgid(65534)
        os.setuid(65534)

    for prefix, says in ((locked / "venvs", "cannot create --prefix"),
                         (locked, "is not writable by this user")):  # fmt: skip
        proc = subprocess.run(
            [python, "-m", MAKE_VENV, "--backend", "deepep_v2", "--prefix", str(prefix)],
            capture_output=True, text=True, preexec_fn=as_nobody, timeout=120,
            env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"},
        )  # fmt: skip
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert says in proc.stderr and str(prefix) in proc.stderr
        no_traceback(proc)
    assert sorted(locked.iterdir()) == []


def blocking_uv(directory: Path, marker: Path) -> dict[str, str]:
    """An environment whose `uv` is the real one except for `uv sync`, which marks that it
    started and then waits: a signal sent after the mark always lands mid-sync, however fast
    the machine (a warm cache builds the venv in seconds: a signal sent on a timer can miss)."""
    from ep_image import tools

    real = shutil.which("uv") or tools.find_uv()
    directory.mkdir(parents=True, exist_ok=True)
    shim = directory / "uv"
    shim.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = sync ]; then touch {marker}; exec sleep 600; fi\n'
        f'exec {real} "$@"\n'
    )
    shim.chmod(0o755)
    return {**os.environ, "PATH": f"{directory}:{os.environ['PATH']}"}


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_mid_build_leaves_nothing_half_built(
    tmp_path: Path, signum: int, code: int
) -> None:
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) or SIGTERM (a CI
    timeout) while uv syncs into the temporary venv: no temporary venv, no lock file, no venv."""
    prefix, marker = tmp_path / "venvs", tmp_path / "sync-started"
    proc = subprocess.Popen(
        [sys.executable, "-m", MAKE_VENV, "--backend", "deepep_v2", "--prefix", str(prefix)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env=blocking_uv(tmp_path / "shim", marker),
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "uv sync never started"
        time.sleep(0.02)
    assert list(prefix.glob(".deepep_v2.tmp-*")), "no temporary venv while syncing"
    if signum == signal.SIGINT:
        os.killpg(proc.pid, signum)
    else:
        os.kill(proc.pid, signum)  # to make_venv alone, as `kill PID` or a job runner does
    out, err = proc.communicate(timeout=300)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert proc.returncode == code, out + err
    assert "no half-built venv is left" in err
    no_traceback(done)
    assert sorted(p.name for p in prefix.iterdir()) == [], "something was left in the prefix"


def test_a_rebuild_swaps_the_venv_in_one_step(tmp_path: Path) -> None:
    """The exchange make_venv uses to replace a venv: both paths exist throughout, each now
    the other's, and the replaced tree is what the rebuild removes."""
    from ep_image.build_steps import atomic_venv

    old, new = tmp_path / "venv", tmp_path / ".venv.tmp-x"
    for path, text in ((old, "old"), (new, "new")):
        path.mkdir()
        (path / "ep-backend.json").write_text(text)
    inodes = (old.stat().st_ino, new.stat().st_ino)
    if not atomic_venv.exchange(new, old):
        pytest.skip("this file system cannot exchange two names (renameat2)")
    assert (old / "ep-backend.json").read_text() == "new"
    assert (new / "ep-backend.json").read_text() == "old"
    assert (old.stat().st_ino, new.stat().st_ino) == inodes[::-1]
    atomic_venv.move_into_place(new, old)  # exchanged back, then the other removed
    assert (old / "ep-backend.json").read_text() == "old" and not new.exists()


def failing_hybridep_env(tmp_path: Path) -> dict[str, str]:
    """HybridEP's git source through a mirror that does not exist: the build fails at the clone,
    seconds after make_venv has cleared the prefix of an interrupted build's leftovers."""
    from test_source_build import rdma_home

    if not (tmp_path / "rdma").exists():
        rdma_home(tmp_path / "rdma")
        fake_cuda(tmp_path / "cuda")
    gitconfig = tmp_path / "gitconfig"
    gitconfig.write_text(
        '[url "file:///nonexistent/github-mirror/"]\n\tinsteadOf = https://github.com/\n'
    )
    return {
        **os.environ,
        "GIT_CONFIG_GLOBAL": str(gitconfig),
        "GIT_CONFIG_NOSYSTEM": "1",
        "UV_CACHE_DIR": str(tmp_path / "uv-cache"),
        "CUDA_HOME": str(tmp_path / "cuda"),
        "RDMA_CORE_HOME": str(tmp_path / "rdma"),
    }


def test_a_venv_kept_by_a_kill_during_the_final_rename_is_removed(tmp_path: Path) -> None:
    prefix = tmp_path / "venvs"
    old = prefix / ".hybridep.old-k1ll3d"  # move_into_place renames the old venv to this first
    (old / "lib").mkdir(parents=True)
    proc = make_venv(
        "--backend", "hybridep", "--prefix", prefix, env=failing_hybridep_env(tmp_path)
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"removing {old} left by an interrupted build" in proc.stdout
    assert leftovers(prefix) == []


def test_a_second_build_of_the_same_venv_fails_and_leaves_the_first_alone(tmp_path: Path) -> None:
    """The lock is held (as by a build in progress) and its temporary venv is live: the second
    build stops at once, naming the holder, and deletes nothing."""
    prefix = tmp_path / "venvs"
    live = prefix / ".hybridep.tmp-inuse"
    (live / "lib").mkdir(parents=True)
    lock = prefix / ".make_venv-hybridep.lock"
    with lock.open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("4242\n")
        held.flush()
        proc = make_venv(
            "--backend", "hybridep", "--prefix", prefix, env=failing_hybridep_env(tmp_path)
        )
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "another make_venv (pid 4242) is building it into" in proc.stderr
        no_traceback(proc)
        assert live.is_dir(), "the first build's temporary venv was deleted"
    # The holder is gone: the next build takes the lock, clears the leftover, removes the lock.
    proc = make_venv(
        "--backend", "hybridep", "--prefix", prefix, env=failing_hybridep_env(tmp_path)
    )
    assert proc.returncode == 1 and "could not clone" in proc.stderr, proc.stderr
    assert not live.exists() and leftovers(prefix) == []


@pytest.mark.parametrize(
    "edit",
    [
        ('deepep_v2 = [\n  "torch==2.14.1",', 'deepep_v2 = [\n  "torch==2.13.0",'),  # a pin
        ("dependencies = []", 'dependencies = ["packaging"]'),  # a new dependency
    ],
)
def test_a_pyproject_changed_without_uv_lock_is_refused(
    tmp_path: Path, edit: tuple[str, str]
) -> None:
    """uv sync --frozen would build the stale lock (and record the new pyproject's hash):
    make_venv refuses before building anything, naming `uv lock`."""
    from _venv_helpers import ROOT

    project = tmp_path / "project"
    shutil.copytree(ROOT, project, ignore=shutil.ignore_patterns(".git", ".venv", "*.pyc"))
    pyproject = project / "pyproject.toml"
    assert edit[0] in pyproject.read_text()
    pyproject.write_text(pyproject.read_text().replace(edit[0], edit[1], 1))
    prefix = tmp_path / "venvs"
    proc = make_venv("--backend", "deepep_v2", "--prefix", prefix, "--project", project)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "is not the lock of" in proc.stderr and "run `uv lock`" in proc.stderr
    no_traceback(proc)
    assert sorted(p.name for p in prefix.iterdir()) == []
