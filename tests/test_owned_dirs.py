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
ROOT = TESTS.parent

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


# ---- a killed Docker test run: what it left in its state and under /run goes at the next start --

#: A Docker test run as tests/_docker_engine.py's ``running`` sets it up, with stand-ins for what
#: its dockerd leaves when the run is killed: a process naming the state (dockerd, containerd, a
#: shim), a BuildKit container's process naming nothing of it (its runc state does, under the
#: /run stand-in), a shim's socket, dockerd's network namespace mounted under the state (nsfs),
#: the build secrets. ``another`` also puts there what another Docker, started later, owns.
DOCKER_RUN = """
import hashlib, json, os, socket, subprocess, sys, time
from pathlib import Path
import _docker_engine, _owned_dirs
parent, run, another = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1"
owned = _owned_dirs.make(parent, "docker-", _docker_engine.leftovers)
state = owned.path
in_run = [run / d.relative_to("/run") for d in _docker_engine.RUN_DIRS]
made = [d for d, here in zip(_docker_engine.RUN_DIRS, in_run) if not here.exists()]
_docker_engine.record_outside(state, made, run=run)
for d in in_run:
    d.mkdir(parents=True, exist_ok=True)
(state / "data").mkdir()
(state / "data" / "layer").write_bytes(b"x" * 4096)
(state / "secrets").mkdir(mode=0o700)
(state / "secrets" / "ca-bundle.pem").write_text("# ep-image-secret-marker\\n")
def detached(*args):
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", *args],
                            start_new_session=True, stdout=subprocess.DEVNULL)
daemon = detached(str(state / "exec" / "containerd" / "containerd.toml"))
container = detached()  # PID 1 of a RUN step: its arguments name nothing of the state
def runc_state(name, pid, rootfs):
    start = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    (run / "runc" / name).mkdir()
    (run / "runc" / name / "state.json").write_text(json.dumps({
        "id": name, "init_process_pid": pid, "init_process_start": start,
        "config": {"rootfs": str(rootfs)}, "cgroup_paths": {}}))
runc_state("step1", container.pid, state / "data" / "buildkit" / "executor" / "step1" / "rootfs")
task = state / "exec" / "containerd" / "daemon" / "io.containerd.runtime.v2.task" / "moby" / "c0"
task.mkdir(parents=True)
address = state / "exec" / "containerd" / "containerd.sock"
shim = run / "containerd" / "s" / hashlib.sha256(f"{address}/moby/c0".encode()).hexdigest()
os.chdir(shim.parent)  # a socket's path has at most 107 bytes: bound by its name
socket.socket(socket.AF_UNIX).bind(shim.name)  # closed unremoved, as a SIGKILL'd shim leaves it
if another:  # a Docker that came after: its socket, its container's state and process
    (run / "docker" / "docker.sock").write_text("")
    theirs = detached()
    runc_state("theirs", theirs.pid, "/var/lib/docker/theirs/rootfs")
    print(theirs.pid)
else:
    print(0)
netns = state / "exec" / "netns" / "default"
netns.parent.mkdir(parents=True)
netns.write_text("")
if sys.argv[4] == "1":  # as dockerd does: the network namespace bound onto a file (nsfs)
    subprocess.run(["mount", "--bind", f"/proc/{container.pid}/ns/net", str(netns)], check=True)
print(state, daemon.pid, container.pid, flush=True)
time.sleep(600)
"""


def _mounted_under(path: Path) -> list[str]:
    return [line for line in Path("/proc/self/mountinfo").read_text().splitlines()
            if f" {path}/" in line]  # fmt: skip


@pytest.mark.parametrize("another", [False, True], ids=["alone", "another-docker-came-later"])
def test_the_next_run_removes_what_a_killed_docker_run_left_as_it_starts(
    tmp_path: Path, another: bool
) -> None:
    """A Docker test run SIGKILLed mid-build left its state (the nsfs mount in it, the secrets),
    its daemon's and a container's processes, and under /run a container's runc state, a shim's
    socket and the directories holding them. The next pytest run, whatever it runs (here one
    test of another module), removes all of it before its first test, and nothing of a Docker
    that is not the dead run's: its socket, its container's state and process stay (before:
    everything stayed until a later run started a dockerd, and /run was never cleaned)."""
    mount = why_not("bind") is None  # root: the real nsfs mount dockerd leaves
    parent, run, cache = tmp_path / "parent", tmp_path / "run", tmp_path / "cache"
    for directory in (parent, run, cache):
        directory.mkdir()
    env = {**os.environ, "PYTHONPATH": str(TESTS), "EP_IMAGE_TEST_CACHE": str(cache)}
    owner = subprocess.Popen(
        [sys.executable, "-c", DOCKER_RUN, parent, run, str(int(another)), str(int(mount))],
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert owner.stdout is not None
    said = [owner.stdout.readline(), owner.stdout.readline()]  # "" if it failed: see its stderr
    assert said[1].count(" ") == 2, said
    theirs = int(said[0])
    state_text, daemon_pid, container_pid = said[1].split()
    state, daemon, container = Path(state_text), int(daemon_pid), int(container_pid)
    try:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        assert owned_dirs.alive(daemon) and owned_dirs.alive(container)
        if mount:
            assert "nsfs" in "".join(_mounted_under(state))
        shim = next((run / "containerd" / "s").iterdir())

        pytest_run = subprocess.run(
            [sys.executable, "-m", "pytest", "-n0", "-p", "no:cacheprovider", "-q",
             f"{TESTS / 'test_owned_dirs.py'}::test_a_directory_without_a_lock_file_is_left_alone"],
            capture_output=True, text=True, timeout=300, cwd=ROOT,
            env={**env, "EP_IMAGE_TEST_STORE_PARENT": str(parent)},
        )  # fmt: skip
        assert pytest_run.returncode == 0, pytest_run.stdout + pytest_run.stderr

        assert not state.exists(), sorted(str(p) for p in state.rglob("*"))
        assert _mounted_under(state) == [], "the dead run's nsfs mount is still there"
        deadline = time.monotonic() + 15
        while (owned_dirs.alive(daemon) or owned_dirs.alive(container)) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.1)
        assert not owned_dirs.alive(daemon), "the dead run's daemon still runs"
        assert not owned_dirs.alive(container), "the dead run's container still runs"
        assert not (run / "runc" / "step1").exists() and not shim.exists()
        left = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
        if another:
            assert left == ["docker", "docker/docker.sock", "docker/plugins", "runc",
                            "runc/theirs", "runc/theirs/state.json"], left  # fmt: skip
            assert owned_dirs.alive(theirs), "another Docker's container was stopped"
        else:
            assert left == [], left
        assert run.is_dir()
    finally:
        owner.kill()
        owner.wait()
        for pid in (daemon, container, theirs):
            if pid and owned_dirs.alive(pid):
                os.kill(pid, signal.SIGKILL)
        for line in _mounted_under(state):
            subprocess.run(["umount", "-l", line.split()[4]], check=False)
