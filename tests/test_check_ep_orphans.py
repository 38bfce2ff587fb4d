"""check_ep's ranks when what started them is gone, and a job that does not fit in memory.

Why: torchrun's agent (and the probe's own ``--nproc-per-node`` launcher, the same agent
in-process) starts each rank in a session of its own. SIGKILLed (a CI timeout, the OOM killer, a
lost ssh session), it left every rank and backend process running for minutes, retrying its
store, with their temporary directories; and a 64-rank job on 24 GiB was killed for memory the
same way, without a report. Here the launcher is SIGKILLed for real once the ranks run (a backend
that hangs in its buffer keeps them running), and every process it started must end on its own
within seconds, leaving nothing in TMPDIR. Memory limits are real memory cgroups made for the
test (root only), so nothing else on the machine is pressed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import clean_env

from ep_image import child_env
from ep_image.probes import _lifeline, _memory

GiB = 1 << 30
HANG = ["--backend-class", "broken_backends:HangsInBuffer", "--scenarios", "none"]
PROBE = [sys.executable, "-m", "ep_image.probes.check_ep"]


def hang(probe: str) -> list[str]:
    """The flags of a run whose ranks hang in the buffer step, for ``probe``."""
    return HANG if probe == "check_ep" else HANG[:2]


def start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return None if fields[0] in ("Z", "X") else fields[19]


def descendants(root: int) -> dict[int, str]:
    """Every process below ``root`` (pid -> start time, so a reused pid is not mistaken)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat[stat.rfind(")") + 2 :].split()[1])
    found, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in found and (start := start_time(child)):
                found[child] = start
                frontier.append(child)
    return found


def still_running(processes: dict[int, str]) -> list[int]:
    return [pid for pid, start in processes.items() if start_time(pid) == start]


def kill_all(processes: dict[int, str]) -> None:
    """The test's own processes, by id, should the probe have left any."""
    for pid in still_running(processes):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def wait_for_ranks(launcher: subprocess.Popen, count: int, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while len(descendants(launcher.pid)) < count:
        assert launcher.poll() is None, "the job ended before its ranks ran"
        assert time.monotonic() < deadline, f"{count} processes never ran"
        time.sleep(0.2)
    time.sleep(2.0)  # in the backend's buffer, where it hangs


def kill_and_watch(launcher: subprocess.Popen, seconds: float = 20) -> tuple[dict, list[int]]:
    """SIGKILL the launcher; what it had started, and what still runs ``seconds`` later."""
    started = descendants(launcher.pid)
    launcher.kill()
    launcher.wait(timeout=30)
    deadline = time.monotonic() + seconds
    while still_running(started) and time.monotonic() < deadline:
        time.sleep(0.2)
    return started, still_running(started)


@pytest.mark.parametrize(
    ("launcher", "probe"),
    [("nproc-per-node", "check_ep"), ("torchrun", "check_ep"), ("nproc-per-node", "check_train")],
)
def test_every_rank_ends_on_its_own_when_its_launcher_is_killed(
    tmp_path: Path, launcher: str, probe: str
) -> None:
    """Two ranks, each with its backend process, hung in the buffer step; the launcher gets
    SIGKILL. Within 20 s every process it started has ended, and TMPDIR holds nothing of the
    probe's (under the probe's own launcher: nothing at all, torchelastic's logs included).
    Each rank says so under the running probe's name (check_train's said "check_ep:")."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = child_env(clean_env(TMPDIR=str(tmpdir)))
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "-m", f"ep_image.probes.{probe}", *HANG]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", f"ep_image.probes.{probe}", *hang(probe), "--nproc-per-node",
               "2"]  # fmt: skip
    log = (tmp_path / "log").open("w")
    job = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=log, stderr=log,
                           start_new_session=True)  # fmt: skip
    started: dict[int, str] = {}
    try:
        wait_for_ranks(job, 4)
        started, left = kill_and_watch(job)
        assert len(started) >= 4, started
        assert left == [], f"{len(left)} of {len(started)} processes still run 20 s later"
        remains = sorted(p.name for p in tmpdir.iterdir())
        if launcher == "torchrun":  # torchrun's own log directory: it leaves one on success too
            remains = [name for name in remains if not name.startswith("torchelastic_")]
        assert remains == [], f"left in TMPDIR: {remains}"
        said = (tmp_path / "log").read_text()
        assert "the process that started it" in said and "is gone" in said, said[-2000:]
        gone = [line for line in said.splitlines() if "the process that started it" in line]
        assert all(line.startswith(f"{probe}: rank ") for line in gone), gone
    finally:
        job.kill()
        kill_all(started)
        log.close()


@pytest.mark.parametrize("probe", ["check_ep", "check_train"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_launcher_stops_its_ranks_and_says_so_once(
    tmp_path: Path, probe: str, sig: signal.Signals
) -> None:
    """Ctrl-C (SIGINT) or SIGTERM of the probe's own launcher while its two ranks run: one
    line, the conventional 128 + the signal, no rank's table or report, and nothing left
    running or in TMPDIR. Before: torchelastic's SignalException traceback and exit 1, with
    rank 0's table of a job "stopped" (exit 3) or each rank's "interrupted" line before it."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", f"ep_image.probes.{probe}", *hang(probe), "--nproc-per-node",
           "2", "--json", str(report)]  # fmt: skip
    out, err = (tmp_path / "out").open("w"), (tmp_path / "err").open("w")
    job = subprocess.Popen(cmd, env=child_env(clean_env(TMPDIR=str(tmpdir))), cwd=tmp_path,
                           stdout=out, stderr=err, start_new_session=True)  # fmt: skip
    started: dict[int, str] = {}
    try:
        wait_for_ranks(job, 4)
        started = descendants(job.pid)
        job.send_signal(sig)
        code = job.wait(timeout=60)
        stdout, stderr = (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
        assert code == 128 + sig, f"exit {code}\n{stdout[-2000:]}\n{stderr[-3000:]}"
        assert stderr.strip().splitlines() == [
            f"{probe}: interrupted ({sig.name}): ranks stopped, no verdict"
        ], stderr[-3000:]
        assert stdout.strip() == "", stdout[-2000:]
        assert not report.exists(), "a rank wrote a report of the job it was stopped in"
        deadline = time.monotonic() + 10
        while still_running(started) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert still_running(started) == [], f"{len(started)} started, these still run"
        assert sorted(p.name for p in tmpdir.iterdir()) == [], "left in TMPDIR"
    finally:
        job.kill()
        kill_all(started)
        out.close()
        err.close()


@pytest.mark.parametrize("child_leaves", [True, False])
def test_a_forked_backend_process_does_not_hold_the_job_directory(
    tmp_path: Path, child_leaves: bool
) -> None:
    """A rank's backend process is forked from it and inherits the job directory's locked
    descriptor: unless it closes that copy, a backend process still dying when its rank leaves
    holds the rank's shared lock, the rank cannot take the exclusive one, and the directory
    stays behind (seen once under load). With the child's copy closed, the rank's leaving
    removes it; the child that keeps its copy shows what the close prevents."""
    job = tmp_path / "job"
    job.mkdir()
    line = _lifeline.Lifeline()
    line._job_fd = _lifeline.hold_job_dir(fcntl.LOCK_SH, str(job))
    assert line._job_fd is not None
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the backend process: alive while its rank leaves
        if child_leaves:
            line.leave_to_parent()
        os.write(ready_w, b"x")
        time.sleep(60)
        os._exit(0)
    try:
        os.read(ready_r, 1)
        _lifeline.leave_job_dir(line._job_fd, str(job))
        assert job.exists() is not child_leaves
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(ready_r)
        os.close(ready_w)


RANK_ENDING_FIRST = """
import os, sys, time
from ep_image.probes import _lifeline
_lifeline.lifeline.start()
print("ready", flush=True)
parent = int(os.environ[_lifeline.LAUNCHER_PID_ENV])
while os.getppid() == parent:
    time.sleep(0.005)
sys.exit(1)  # as a store call on the dead launcher's socket ends the rank's main thread
"""

LAUNCHER_DYING = """
import os, subprocess, sys
from ep_image.probes import _lifeline
env = dict(os.environ, **{_lifeline.LAUNCHER_PID_ENV: str(os.getpid()),
                          _lifeline.JOB_DIR_ENV: sys.argv[1]})
rank = subprocess.Popen([sys.executable, "-c", sys.argv[2]], env=env, stdout=subprocess.PIPE,
                        text=True, start_new_session=True)
assert rank.stdout.readline().strip() == "ready"
print(rank.pid, flush=True)
os._exit(0)
"""


def test_a_rank_whose_main_thread_ends_first_still_removes_the_job_directory(
    tmp_path: Path,
) -> None:
    """The launcher dies and the rank's main thread exits at once (its store calls fail), before
    the lifeline's watch has looked: the rank's exit still lets go of the job's directory, and
    as the last holder removes it (seen once under load: the directory stayed behind)."""
    job = tmp_path / "job"
    job.mkdir()
    launched = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(LAUNCHER_DYING), str(job), RANK_ENDING_FIRST],
        env=child_env(clean_env()), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert launched.returncode == 0, launched.stderr
    rank = int(launched.stdout.split()[-1])
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (Path(f"/proc/{rank}").exists() or job.exists()):
        time.sleep(0.05)
    assert not Path(f"/proc/{rank}").exists(), "the rank still runs 15 s after its launcher died"
    assert not job.exists(), "the job's directory stayed behind"


# ---- memory ---------------------------------------------------------------------------------


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[Path]:
    """A memory cgroup below this process's own, limited to ``limit`` bytes (and no swap); its
    processes are killed and it is removed at the end."""
    dirs = _memory._cgroup_dirs()
    if os.geteuid() != 0 or not dirs:
        pytest.skip("a memory cgroup of the test's own needs root and a memory controller")
    parent, names = dirs[0]
    group = parent / f"ep-image-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup here ({exc})")
    try:
        if names[0] == "memory.max":
            (group / "memory.max").write_text(str(limit))
            with contextlib.suppress(OSError):
                (group / "memory.swap.max").write_text("0")
        else:
            (group / "memory.limit_in_bytes").write_text(str(limit))
            with contextlib.suppress(OSError):
                (group / "memory.memsw.limit_in_bytes").write_text(str(limit))
        yield group
    finally:
        for _ in range(50):
            pids = [int(p) for p in (group / "cgroup.procs").read_text().split()]
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
        group.rmdir()


def in_cgroup(group: Path, cmd: list[str]) -> list[str]:
    """``cmd`` run as a process of ``group``."""
    return ["sh", "-c", f'echo $$ > {group / "cgroup.procs"} && exec "$@"', "sh", *cmd]


def private_tmp(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment of a run whose temporary files stay under ``tmp_path``, whatever the
    cgroup's end (a SIGKILL) leaves."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir(exist_ok=True)
    return child_env(clean_env(TMPDIR=str(tmpdir), **extra))


def test_a_job_that_cannot_fit_in_memory_is_refused_before_any_rank_starts(tmp_path: Path):
    """Eight ranks (sixteen Pythons with torch imported) in 2 GiB: refused as bad usage, one
    line naming what it needs, what there is and the fix (before: started, and the OOM killer
    ended processes one by one without a report)."""
    with memory_cgroup(2 * GiB) as group:
        proc = subprocess.run(
            in_cgroup(group, [*PROBE, "--backend", "torch", "--nproc-per-node", "8"]),
            env=private_tmp(tmp_path), cwd=tmp_path, capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("check_ep: usage error: "), proc.stderr
    assert "--nproc-per-node 8" in lines[0] and "memory" in lines[0], lines[0]
    assert str(group) in lines[0], "it names where the limit comes from"


def test_a_rank_the_oom_killer_ends_is_reported_as_that(tmp_path: Path):
    """Rank 1's backend takes memory until its cgroup's OOM killer ends it: rank 0 reports it
    as out of memory, naming the fix, not as a crash in native code."""
    report = tmp_path / "report.json"
    with memory_cgroup(int(2.5 * GiB)) as group:
        proc = subprocess.run(
            in_cgroup(group, [*PROBE, "--backend-class", "broken_backends:OutOfMemoryOnRankOne",
                              "--scenarios", "none", "--nproc-per-node", "2", "--json",
                              str(report)]),
            env=private_tmp(tmp_path, EP_TEST_ALLOCATE_BYTES=str(4 * GiB)), cwd=tmp_path,
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(report.read_text())
    step = next(s for s in data["steps"] if s["status"] == "error")
    assert "rank 1" in step["detail"] and "out-of-memory killer" in step["detail"], step
    assert "fewer ranks" in step["hint"] or "memory" in step["hint"], step["hint"]
    assert "crashed in native code" not in step["hint"]
