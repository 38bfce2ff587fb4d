"""Run a probe's work in a forked child, so a crash in native code is reported, not inherited.

Why this module exists: EP backends are CUDA extensions, and their failures are not always
Python exceptions. On a GPU machine HybridEP's buffer constructor ended the probe with
SIGSEGV, leaving no table and no JSON report, only "Segmentation fault" from the shell. A
probe that dies with the thing it probes answers nothing. So the work runs in a forked child:
the parent (which holds no CUDA state) waits, and when the child is killed by a signal it
reports which step was running, with the Python stack faulthandler wrote, as exit 3.

The child leaves a breadcrumb (a small JSON file: the steps finished so far and the one in
progress) that the parent reads after a crash. The child dies with its parent (Linux
``PR_SET_PDEATHSIG``), and SIGTERM sent to the parent (torchrun stopping a job) is passed on.
"""

from __future__ import annotations

import ctypes
import faulthandler
import json
import os
import signal
import sys
import sysconfig
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _report import write_json_atomic

#: Set in the child, so nested calls (and tests) can tell they already run supervised.
CHILD_ENV = "EP_PROBE_SUPERVISED"


@dataclass
class Crash:
    """How the supervised child ended when it did not exit normally."""

    signal_name: str
    progress: dict[str, Any]
    fault_log: str

    @property
    def where(self) -> str:
        """The innermost frame faulthandler recorded outside Python's own library.

        faulthandler lists the most recent call first; a crash inside ``ctypes`` or another
        standard module is attributed to the caller that reached it.
        """
        stdlib = sysconfig.get_paths()["stdlib"]
        frames = [
            line.strip() for line in self.fault_log.splitlines() if line.strip().startswith("File ")
        ]
        for frame in frames:
            if stdlib not in frame:
                return frame
        return frames[0] if frames else ""


class Progress:
    """The breadcrumb the child updates; a no-op outside supervision."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.state: dict[str, Any] = {}

    def update(self, **fields: Any) -> None:
        self.state.update(fields)
        if self.path is not None:
            write_json_atomic(self.path, self.state)


#: The current process's breadcrumb (set in the supervised child).
progress = Progress(None)


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_supervised(work: Callable[[], int]) -> tuple[int, Crash | None]:
    """Run ``work`` in a forked child; return its exit code, or 3 and a Crash on a signal.

    Falls back to calling ``work`` directly where fork is unavailable or when already inside
    a supervised child.
    """
    if not hasattr(os, "fork") or os.environ.get(CHILD_ENV):
        return work(), None
    tmp = Path(tempfile.mkdtemp(prefix="ep-probe-"))
    crumb, fault_path = tmp / "progress.json", tmp / "fault.log"
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: do the work, never return into the caller
        code = 3
        try:
            _die_with_parent()
            os.environ[CHILD_ENV] = "1"
            progress.path = crumb
            fault_file = open(fault_path, "w")  # noqa: SIM115 - must outlive this frame
            faulthandler.enable(file=fault_file, all_threads=False)
            code = work()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException as exc:
            print(f"probe: unexpected {type(exc).__name__}: {exc}", file=sys.stderr)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: os.kill(pid, signum))
    try:
        while True:
            try:
                _, status = os.waitpid(pid, 0)
                break
            except InterruptedError:
                continue
    finally:
        signal.signal(signal.SIGTERM, previous)
    code = os.waitstatus_to_exitcode(status)
    crash = None
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        try:
            state = json.loads(crumb.read_text())
        except (OSError, ValueError):
            state = {}
        try:
            fault = fault_path.read_text()
        except OSError:
            fault = ""
        crash = Crash(name, state, fault)
        code = 3
    for path in (crumb, fault_path):
        path.unlink(missing_ok=True)
    tmp.rmdir() if not any(tmp.iterdir()) else None
    return code, crash
