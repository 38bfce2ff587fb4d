"""A rank ends when what started it is gone, taking its processes and temporary files with it.

Why: torchrun's agent (and the probe's own ``--nproc-per-node`` launcher, which runs the same
agent in-process) starts each rank in a session of its own and never tells it that the agent
died. Killed by a CI timeout, the OOM killer or a lost ssh session, it leaves every rank
retrying the dead agent's store for minutes, each rank's backend process running on, and their
temporary directories behind. Here a thread of each launched rank's process watches its parent
and, when that is gone, stops the rank's backend process group, removes the rank's temporary
directories and ends the rank within a second or two; under the probe's own launcher the last
rank out removes the job's directory (docs/probes.md, "check-ep").
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import shutil
import signal
import sys
import threading
import time

#: Set by the probe's own launcher (_ranks/launch.py): its pid, and the job's directory (the
#: ranks' TMPDIR, its torchelastic logs, the exit-code file), which the last process removes.
LAUNCHER_PID_ENV = "EP_PROBE_LAUNCHER_PID"
JOB_DIR_ENV = "EP_PROBE_JOB_DIR"
#: How often the parent is looked at.
POLL_SECONDS = 0.5
#: A rank whose launcher is gone exits as a process hung up on does.
EXIT_ORPHANED = 128 + signal.SIGHUP

#: The parent this process had when it started (as near to it as an import gets): under
#: torchrun nothing else names the agent.
_PARENT_AT_START = os.getppid()


def launched(environ: dict[str, str] | os._Environ[str] | None = None) -> bool:
    """Whether this process is a rank some launcher started (torchrun's variables, or ours)."""
    env = os.environ if environ is None else environ
    return LAUNCHER_PID_ENV in env or ("WORLD_SIZE" in env and "MASTER_ADDR" in env)


def expected_parent() -> int:
    """The pid of what started this rank: the probe's launcher as it said, else the parent at
    start (torchrun's agent)."""
    value = os.environ.get(LAUNCHER_PID_ENV, "")
    return int(value) if value.isdigit() else _PARENT_AT_START


class Lifeline:
    """This process's watch on its parent, and what it must take down when the parent goes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups: set[int] = set()
        self._paths: set[str] = set()
        self._thread: threading.Thread | None = None
        self._job_fd: int | None = None
        self._pid = 0  # the process that started the watch (a forked child is not it)
        self._ending = False
        self._who = ""

    def start(self, who: str = "") -> None:
        """Watch the parent (once per process; only in a launched rank); ``who`` begins what
        it says when the parent is gone ("check_train: rank 1"; the rank of RANK by default)."""
        with self._lock:
            if self._thread is not None or not launched():
                return
            self._who = who or f"rank {os.environ.get('RANK', '?')}"
            self._job_fd = hold_job_dir(fcntl.LOCK_SH)
            self._pid = os.getpid()
            self._thread = threading.Thread(target=self._watch, name="ep-lifeline", daemon=True)
            self._thread.start()
            atexit.register(self._at_exit)

    def _at_exit(self) -> None:
        """The rank is exiting on its own (its store calls fail once the launcher is gone, and
        the exception can end the main thread before the watch has seen it): if the parent is
        gone, or the watch is already ending the rank, finish that here, or the daemon watch
        dies with the interpreter before it lets go of the job's directory."""
        if os.getpid() != self._pid:
            return
        parent = expected_parent()
        if self._ending or os.getppid() != parent:
            self.end(parent)

    def own_group(self, pgid: int) -> None:
        """A process group (the backend process's) to stop if the parent goes."""
        with self._lock:
            self._groups.add(pgid)

    def own_path(self, path: str | os.PathLike[str]) -> None:
        """A temporary directory of this process's to remove if the parent goes."""
        with self._lock:
            self._paths.add(os.fspath(path))

    def leave_to_parent(self) -> None:
        """In a forked child: close the copy of the job directory's descriptor the fork gave
        it. A flock belongs to the descriptor's shared open file, so a child that kept the copy
        would hold the rank's shared lock until it died: a child slow to die after SIGKILL made
        every rank's exclusive try fail, and the job's directory stayed behind."""
        fd, self._job_fd = self._job_fd, None  # no lock: another thread may hold it at the fork
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def release_group(self, pgid: int) -> None:
        """The group ended the ordinary way."""
        with self._lock:
            self._groups.discard(pgid)

    def release_path(self, path: str | os.PathLike[str]) -> None:
        """The directory was removed the ordinary way."""
        with self._lock:
            self._paths.discard(os.fspath(path))

    def _watch(self) -> None:
        parent = expected_parent()
        while os.getppid() == parent:
            time.sleep(POLL_SECONDS)
        self.end(parent)

    def end(self, parent: int) -> None:
        """The parent is gone: say so, stop the owned groups, remove the owned directories, let
        go of the job's directory (removing it when last) and exit."""
        with self._lock:
            first, self._ending = not self._ending, True
        if not first:  # the other thread is ending this process: its os._exit comes
            time.sleep(30)
            os._exit(EXIT_ORPHANED)
        with contextlib.suppress(Exception):
            print(
                f"{self._who}: the process that started it (pid {parent}) is gone: "
                "stopping this rank and its backend process",
                file=sys.stderr,
                flush=True,
            )
        with self._lock:
            groups, paths = sorted(self._groups), sorted(self._paths)
        for pgid in groups:
            with contextlib.suppress(OSError):
                os.killpg(pgid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        for pgid in groups:  # reap them: no zombie outlives this process either
            while time.monotonic() < deadline:
                try:
                    done, _ = os.waitpid(pgid, os.WNOHANG)
                except ChildProcessError:
                    break
                if done:
                    break
                time.sleep(0.05)
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)
        leave_job_dir(self._job_fd)
        os._exit(EXIT_ORPHANED)


def hold_job_dir(lock: int, job: str | None = None) -> int | None:
    """Open the job's directory (``job``, else JOB_DIR_ENV's) and lock it (shared while a
    process uses it); None where there is none, it is gone already, or the lock is taken."""
    job = job or os.environ.get(JOB_DIR_ENV)
    if not job:
        return None
    try:
        fd = os.open(job, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, lock | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def leave_job_dir(fd: int | None, job: str | None = None) -> None:
    """Let go of the job's directory (``job``, else JOB_DIR_ENV's) and, if no other process of
    the job still holds it, remove it: each holds a shared lock, so the exclusive one succeeds
    for the last only."""
    job = job or os.environ.get(JOB_DIR_ENV)
    if fd is not None:
        os.close(fd)
    if not job:
        return
    last = hold_job_dir(fcntl.LOCK_EX, job)
    if last is not None:
        shutil.rmtree(job, ignore_errors=True)
        os.close(last)


#: This process's lifeline (started by the supervisor of a launched rank).
lifeline = Lifeline()
