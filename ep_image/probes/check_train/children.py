"""Child processes that end by a deadline and never outlive the process that started them.

Why this module exists: ``check-train --all-backends`` runs another venv's python per backend,
and any of them can hang (waited on forever), crash, or be left running with its temporary
directory when the launcher itself is stopped (SIGTERM, Ctrl-C) or killed (SIGKILL, the OOM
killer). Each child here runs in a process group of its own, under a deadline, and dies with
the launcher's thread that started it (``PR_SET_PDEATHSIG``); a watcher process in a session of
its own holds the other end of a pipe from the launcher and, when that pipe closes without the
launcher having released them (the launcher is gone, however it ended), kills every group still
running and removes the directories it was given. Standard library only.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ep_image import cli

#: Seconds a stopped child's group gets between SIGTERM and SIGKILL: check_train's own
#: supervisor then stops its backend process and its launcher its ranks.
GRACE_S = 5.0

#: The watcher: reads "+G pgid", "-G pgid", "+P path", "-P path" lines from its stdin; at end of
#: input kills every group still held and removes every directory still held. It ignores the
#: signals that stop the launcher (a Ctrl-C reaches the whole foreground group).
_WATCHER = r"""
import os, shutil, signal, sys
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
held = {"G": set(), "P": set()}
for line in sys.stdin:
    op, kind, arg = line[:1], line[1:2], line[3:].rstrip("\n")
    if kind in held and arg:
        (held[kind].add if op == "+" else held[kind].discard)(arg)
for pgid in held["G"]:
    try:
        os.killpg(int(pgid), signal.SIGKILL)
    except (OSError, ValueError):
        pass
for path in held["P"]:
    shutil.rmtree(path, ignore_errors=True)
"""


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the thread that started it ends (the launcher
    killed), kept across exec (not setuid)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def signal_name(signum: int) -> str:
    """``SIGSEGV`` for 11; the number where Python has no name for it."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@dataclass
class Ended:
    """How a child ended: its exit status as ``Popen.returncode`` has it (negative: the
    signal), whether it ran past its deadline (then stopped), the seconds it ran, and its
    output when captured."""

    returncode: int
    timed_out: bool
    seconds: float
    stdout: str = ""

    def how(self, deadline: str = "") -> str:
        """In words: ``timed out after 6 s (deadline)``, ``killed by SIGSEGV``, ``exited 7``."""
        if self.timed_out:
            return f"timed out after {self.seconds:.0f} s" + (f" ({deadline})" if deadline else "")
        if self.returncode < 0:
            return f"killed by {signal_name(-self.returncode)}"
        return f"exited {self.returncode}"


class Keeper:
    """The children of one launcher, and the watcher that ends them if the launcher dies."""

    def __init__(self) -> None:
        self._watcher: subprocess.Popen[str] | None = None
        self._running: set[int] = set()
        try:
            self._watcher = subprocess.Popen(
                [sys.executable, "-I", "-c", _WATCHER],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                text=True,
                start_new_session=True,  # no signal to the launcher's group reaches it
            )
        except OSError:
            self._watcher = None  # the children still die with the launcher (PDEATHSIG)

    def _tell(self, line: str) -> None:
        if self._watcher is None or self._watcher.stdin is None:
            return
        with contextlib.suppress(OSError, ValueError):
            self._watcher.stdin.write(line + "\n")
            self._watcher.stdin.flush()

    def hold_path(self, path: str | os.PathLike[str]) -> None:
        """A directory the watcher removes if the launcher dies before releasing it."""
        self._tell(f"+P {os.fspath(path)}")

    def release_path(self, path: str | os.PathLike[str]) -> None:
        self._tell(f"-P {os.fspath(path)}")

    def run(
        self,
        cmd: Sequence[str],
        *,
        env: dict[str, str],
        deadline: float | None,
        capture: bool = False,
    ) -> Ended:
        """Run ``cmd`` to its end or its deadline (seconds; then SIGTERM to its group, SIGKILL
        after ``GRACE_S``); whatever is left in its group is killed either way. ``capture``:
        its stdout is kept (its stderr dropped). An interrupt (Ctrl-C, ``cli.Terminated``)
        stops the group and goes on up."""
        start = time.monotonic()
        with self._child(cmd, env, capture) as proc:
            try:
                stdout, _ = proc.communicate(timeout=deadline)
            except subprocess.TimeoutExpired:
                _stop(proc)
                return Ended(proc.returncode, True, time.monotonic() - start)
            return Ended(proc.returncode, False, time.monotonic() - start, stdout or "")

    @contextmanager
    def _child(self, cmd: Sequence[str], env: dict[str, str], capture: bool) -> Iterator[Any]:
        proc = subprocess.Popen(
            list(cmd),
            env=env,
            stdout=subprocess.PIPE if capture else None,
            stderr=subprocess.DEVNULL if capture else None,
            text=True,
            process_group=0,
            preexec_fn=_die_with_parent,
        )
        self._running.add(proc.pid)
        self._tell(f"+G {proc.pid}")
        try:
            yield proc
        except BaseException:
            _stop(proc, grace=0.0)
            raise
        finally:
            _kill_group(proc.pid)  # what it started and left running
            with contextlib.suppress(ChildProcessError):
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
            self._running.discard(proc.pid)
            self._tell(f"-G {proc.pid}")

    def close(self) -> None:
        """Every child still running stopped; the watcher told there is nothing left."""
        for pgid in sorted(self._running):
            _kill_group(pgid)
        if self._watcher is not None:
            with contextlib.suppress(OSError, ValueError):
                if self._watcher.stdin is not None:
                    self._watcher.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._watcher.wait(timeout=10)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(pgid, signal.SIGKILL)


def _stop(proc: subprocess.Popen[Any], grace: float = GRACE_S) -> None:
    """SIGTERM to the child's group, SIGKILL to it after ``grace`` seconds; reaped."""
    if grace > 0:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    _kill_group(proc.pid)
    proc.wait()


def _terminated(signum: int, _frame: object) -> None:
    raise cli.Terminated(signum)


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP raise ``cli.Terminated`` here (as Ctrl-C raises KeyboardInterrupt),
    so the children are stopped and the temporary directory removed on the way out."""
    previous = {s: signal.signal(s, _terminated) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
