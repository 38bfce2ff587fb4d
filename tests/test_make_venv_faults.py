"""ep_image/build_steps/make_venv/ when the user's machine gets in the way: one line naming the
fix, no traceback, nothing half-built left, and never a second build deleting the first one's
work.

Real processes: a prefix that is a file, one this user may not write (make_venv run as nobody),
Ctrl-C (SIGINT to the process group, as a terminal sends it) in the middle of a real build,
leftovers of a build killed during its final rename, and two builds of one venv into one prefix.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
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
    from ep_image.build_steps._uv import pinned

    real = shutil.which("uv") or pinned.find_uv()
    directory.mkdir(parents=True, exist_ok=True)
    shim = directory / "uv"
    shim.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = sync ]; then touch {marker}; exec sleep 600; fi\n'
        f'exec {real} "$@"\n'
    )
    shim.chmod(0o755)
    return {**os.environ, "PATH": f"{directory}:{os.environ['PATH']}"}


@pytest.mark.parametrize(
    ("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)]
)
def test_a_signal_mid_build_leaves_nothing_half_built(
    tmp_path: Path, signum: int, code: int
) -> None:
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it), SIGTERM (a CI
    timeout) or SIGHUP (a closed terminal, handled like SIGTERM) while uv syncs into the
    temporary venv: no temporary venv, no lock file, no venv."""
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
    from ep_image.build_steps.make_venv import atomic_venv

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


def two_venvs(tmp_path: Path) -> tuple[Path, Path]:
    """An old venv in place and a new one under its temporary name, each naming itself."""
    final, temp = tmp_path / "venv", tmp_path / ".venv.tmp-x"
    for path, text in ((final, "old"), (temp, "new")):
        path.mkdir()
        (path / "ep-backend.json").write_text(text)
    return final, temp


def cannot_exchange(monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system without RENAME_EXCHANGE (renameat2 answers EINVAL): the fallback runs."""
    from ep_image.build_steps.make_venv import atomic_venv

    def refuse(a: Path, b: Path, flags: int) -> None:
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), str(a), None, str(b))

    monkeypatch.setattr(atomic_venv, "_renameat2", refuse)


@pytest.mark.parametrize("other_thread", [False, True], ids=["one-thread", "other-thread"])
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_without_an_exchange_a_signal_between_the_renames_waits_for_them(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
    signum: int,
    other_thread: bool,
) -> None:
    """A signal between the renaming aside of the old venv and the renaming in of the new one
    left no venv at all (and make_venv then deleted the new one): now it is held back until
    the new venv is in place and the old one under the temporary name its caller removes.
    With another thread running (a server, a heartbeat), a held-back signal mask was not
    enough: the kernel gave the signal to that thread, and its handler ran in the main thread
    between the renames all the same."""
    from ep_image import cli
    from ep_image.build_steps.make_venv import atomic_venv

    if other_thread:
        stop = threading.Event()
        threading.Thread(target=stop.wait, daemon=True).start()
        request.addfinalizer(stop.set)
    final, temp = two_venvs(tmp_path)
    cannot_exchange(monkeypatch)
    real_rename = os.rename

    def rename(src: str | Path, dst: str | Path) -> None:
        real_rename(src, dst)
        if Path(dst).name.startswith(".venv.old-"):
            os.kill(os.getpid(), signum)  # delivered before kill() returns, unless held back
            time.sleep(0.2)  # or to another thread: time for it to take it, were it not held

    monkeypatch.setattr(os, "rename", rename)
    handlers = {
        signal.SIGINT: signal.default_int_handler,  # as a terminal's Ctrl-C finds it
        signal.SIGTERM: cli._raise_terminated,
        signal.SIGHUP: cli._raise_terminated,
    }
    for sig, handler in handlers.items():  # as make_venv's cli.run sets them
        request.addfinalizer(functools.partial(signal.signal, sig, signal.getsignal(sig)))
        signal.signal(sig, handler)
    with pytest.raises(KeyboardInterrupt):
        atomic_venv.move_into_place(temp, final)
    assert (final / "ep-backend.json").read_text() == "new"
    assert (temp / "ep-backend.json").read_text() == "old"  # make_venv's cleanup removes it
    assert sorted(p.name for p in tmp_path.iterdir()) == [".venv.tmp-x", "venv"]


def test_without_an_exchange_a_failed_rename_puts_the_old_venv_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ep_image.build_steps.make_venv import atomic_venv

    final, temp = two_venvs(tmp_path)
    cannot_exchange(monkeypatch)
    real_rename = os.rename

    def rename(src: str | Path, dst: str | Path) -> None:
        if Path(src) == temp:
            raise OSError(errno.EIO, "the disk went away", str(src))
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="the disk went away"):
        atomic_venv.move_into_place(temp, final)
    assert (final / "ep-backend.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".venv.tmp-x", "venv"]


#: make_venv as a user runs it, on a file system the test chooses (EP_TEST_NO_EXCHANGE: none
#: that can exchange two names), with a signal sent to itself at the moment the test names:
#: EP_TEST_SIGNAL_AT "aside" (right after the old venv is renamed aside) or "removal" (as the
#: old venv starts to be removed; EP_TEST_SIGNALS of them, one per removal). EP_TEST_EXCHANGES
#: logs each exchange make_venv asks for.
DRIVER = """
import errno, json, os, shutil, signal, sys
from pathlib import Path
from ep_image.build_steps import make_venv
from ep_image.build_steps.make_venv import atomic_venv

signum = int(os.environ.get("EP_TEST_SIGNUM", "0"))
at = os.environ.get("EP_TEST_SIGNAL_AT", "")
left = [int(os.environ.get("EP_TEST_SIGNALS", "1"))]
if os.environ.get("EP_TEST_NO_EXCHANGE"):
    def refuse(a, b, flags):
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), str(a), None, str(b))
    atomic_venv._renameat2 = refuse
log = os.environ.get("EP_TEST_EXCHANGES")
if log:
    real_exchange = atomic_venv.exchange
    def exchange(a, b):
        done = real_exchange(a, b)
        with open(log, "a") as out:
            out.write(json.dumps([str(a), str(b), done]) + "\\n")
        return done
    atomic_venv.exchange = exchange

def fire():
    if left[0] > 0:
        left[0] -= 1
        os.kill(os.getpid(), signum)

real_rename, real_rmtree = os.rename, shutil.rmtree
def rename(src, dst, *args, **kwargs):
    real_rename(src, dst, *args, **kwargs)
    if at == "aside" and ".old-" in Path(dst).name:
        fire()
def rmtree(path, *args, **kwargs):
    record = Path(path) / "ep-backend.json"
    if at == "removal" and record.is_file() and record.read_text() == "OLD":
        fire()
    return real_rmtree(path, *args, **kwargs)
os.rename, shutil.rmtree = rename, rmtree
sys.exit(make_venv.main(sys.argv[1:]))
"""

#: A small deepep_v2 venv (none of the big wheels): seconds from a warm uv cache.
SMALL_VENV = ["--no-install-packages", "torch sgl-deep-ep numpy triton"]


def rebuild_over_an_old_venv(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """make_venv (through DRIVER) building deepep_v2 into a prefix that holds an old one."""
    prefix = tmp_path / "venvs"
    old = prefix / "deepep_v2"
    for part in range(20):  # a tree whose removal takes a few steps
        (old / "lib" / f"part{part}").mkdir(parents=True)
        (old / "lib" / f"part{part}" / "file").write_text("old\n")
    (old / "ep-backend.json").write_text("OLD")
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    args = ["--backend", "deepep_v2", "--prefix", str(prefix), *SMALL_VENV]
    return subprocess.run(
        [sys.executable, str(driver), *args], capture_output=True, text=True, timeout=900,
        env={**os.environ, **env},
    )  # fmt: skip


def new_venv_in_place(prefix: Path) -> None:
    record = (prefix / "deepep_v2" / "ep-backend.json").read_text()
    assert record != "OLD" and json.loads(record)["backend"] == "deepep_v2"


@pytest.mark.parametrize(
    ("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)]
)
def test_make_venv_without_an_exchange_survives_a_signal_between_its_renames(
    tmp_path: Path, signum: int, code: int
) -> None:
    """Before: no deepep_v2, the new venv deleted, the old one left as .deepep_v2.old-* (and
    the next build deleted that too). Now the renames finish, then the signal ends make_venv:
    the new venv is in place, nothing else is left, and what it says is so."""
    proc = rebuild_over_an_old_venv(
        tmp_path, EP_TEST_NO_EXCHANGE="1", EP_TEST_SIGNAL_AT="aside", EP_TEST_SIGNUM=str(signum)
    )
    assert proc.returncode == code, proc.stdout + proc.stderr
    new_venv_in_place(tmp_path / "venvs")
    assert leftovers(tmp_path / "venvs") == []
    assert "no half-built venv is left" in proc.stderr
    no_traceback(proc)


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "no-exchange"])
def test_a_signal_while_the_old_venv_is_removed_leaves_no_part_of_it(
    tmp_path: Path, exchange: bool
) -> None:
    """Ctrl-C as the replaced venv is being deleted: the new venv stays, the rest of the old one
    is removed (without an exchange it was left as .deepep_v2.old-*, while make_venv said no
    half-built venv was left)."""
    if exchange and not can_exchange(tmp_path):
        pytest.skip("this file system cannot exchange two names (renameat2)")
    env = {"EP_TEST_SIGNAL_AT": "removal", "EP_TEST_SIGNUM": str(signal.SIGINT)}
    proc = rebuild_over_an_old_venv(tmp_path, **env, EP_TEST_NO_EXCHANGE="" if exchange else "1")
    assert proc.returncode == 130, proc.stdout + proc.stderr
    new_venv_in_place(tmp_path / "venvs")
    assert leftovers(tmp_path / "venvs") == []
    assert "no half-built venv is left" in proc.stderr
    no_traceback(proc)


def test_a_second_signal_during_the_cleanup_is_said_with_what_it_left(tmp_path: Path) -> None:
    """A second Ctrl-C stops the cleanup itself: make_venv names what is left (it said no
    half-built venv was left), and the next build of the backend removes it."""
    env = {"EP_TEST_SIGNAL_AT": "removal", "EP_TEST_SIGNUM": str(signal.SIGINT)}
    proc = rebuild_over_an_old_venv(tmp_path, **env, EP_TEST_SIGNALS="2")
    assert proc.returncode == 130, proc.stdout + proc.stderr
    prefix = tmp_path / "venvs"
    left = [p.name for p in leftovers(prefix)]
    assert len(left) == 1 and left[0].startswith(".deepep_v2."), left
    assert f"{left[0]} is still under {prefix}" in proc.stderr, proc.stderr
    assert "no half-built venv is left" not in proc.stderr
    new_venv_in_place(prefix)


def can_exchange(where: Path) -> bool:
    from ep_image.build_steps.make_venv import atomic_venv

    a, b = where / "probe-a", where / "probe-b"
    a.mkdir()
    b.mkdir()
    try:
        return atomic_venv.exchange(a, b)
    finally:
        a.rmdir()
        b.rmdir()


def test_make_venv_replaces_a_venv_through_the_exchange(tmp_path: Path) -> None:
    """Not only the helper: a rebuild by make_venv asks for the exchange of its new venv with
    the old one, which the file system does, and nothing else is left."""
    if not can_exchange(tmp_path):
        pytest.skip("this file system cannot exchange two names (renameat2)")
    log = tmp_path / "exchanges.jsonl"
    proc = rebuild_over_an_old_venv(tmp_path, EP_TEST_EXCHANGES=str(log))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    prefix = tmp_path / "venvs"
    [(temp, final, done)] = [json.loads(line) for line in log.read_text().splitlines()]
    assert Path(temp).parent == prefix and Path(temp).name.startswith(".deepep_v2.tmp-")
    assert (final, done) == (str(prefix / "deepep_v2"), True)
    new_venv_in_place(prefix)
    assert leftovers(prefix) == []


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


def test_a_venv_kept_aside_by_a_kill_between_the_renames_is_put_back(tmp_path: Path) -> None:
    """Where no exchange is possible, a SIGKILL between the first two renames leaves the old
    venv as .<backend>.old-* and no <prefix>/<backend>: the next build puts it back (it deleted
    it before), even one that then fails. Beside a venv in place, a .old-* is removed."""
    prefix = tmp_path / "venvs"
    old = prefix / ".hybridep.old-k1ll3d"  # move_into_place renames the old venv to this first
    (old / "lib").mkdir(parents=True)
    (old / "ep-backend.json").write_text('{"backend": "hybridep"}\n')
    env = failing_hybridep_env(tmp_path)
    proc = make_venv("--backend", "hybridep", "--prefix", prefix, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"restoring {prefix / 'hybridep'} from {old}" in proc.stdout
    assert (prefix / "hybridep" / "ep-backend.json").read_text() == '{"backend": "hybridep"}\n'
    assert leftovers(prefix) == []

    (old / "lib").mkdir(parents=True)  # a kill after the second rename: the new venv is in place
    proc = make_venv("--backend", "hybridep", "--prefix", prefix, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"removing {old} left by an interrupted build" in proc.stdout
    assert leftovers(prefix) == [] and (prefix / "hybridep" / "ep-backend.json").is_file()


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
