"""Run a probe's work in a forked child and watch it: crashes, early exits and hangs.

A backend can segfault, ``os._exit`` mid-dispatch or hang holding the GIL; the parent, which
holds no CUDA state, turns each of these (and a peer's failure on the job's board, or SIGTERM)
into a verdict. See docs/probes.md, section "Backends".
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import getpass
import json
import os
import re
import shutil
import signal
import sys
import sysconfig
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ep_image.probes import _memory, _venv_record
from ep_image.probes._lifeline import lifeline
from ep_image.probes._report import write_json_atomic

#: Set in the child, so nested calls (and tests) can tell they already run supervised.
CHILD_ENV = "EP_PROBE_SUPERVISED"

#: How often the parent looks at the child, its breadcrumbs and the board.
POLL_SECONDS = 0.1

#: A file the parent creates beside the breadcrumbs before it stops the child.
STOP_MARKER = "stopping"
#: The backend call the child is in, beside the breadcrumbs (``Progress.mark_call``).
CALL_FILE = "call"


@dataclass
class Outcome:
    """How the supervised child ended.

    ``how``: ``finished`` (it returned a verdict), ``signal`` (killed by one), ``exit`` (it
    exited without a verdict), ``hang`` (a step outran the deadline), ``stall`` (it stopped
    making progress in a step its peers finished: ``Watch.stalled``), ``error`` (the probe's
    own code raised, most often a collective that lost a peer), ``stopped`` (ended because
    another rank failed or the launcher sent SIGTERM).
    """

    how: str
    code: int
    progress: dict[str, Any] = field(default_factory=dict)
    fault_log: str = ""
    signal_name: str = ""
    exit_status: int | None = None
    seconds_in_step: float = 0.0

    @property
    def step(self) -> str | None:
        return self.progress.get("current")

    @property
    def where(self) -> str:
        return innermost_frame(self.fault_log)

    def to_json(self) -> dict[str, Any]:
        return {
            "how": self.how,
            "code": self.code,
            "step": self.step,
            "scenario": self.progress.get("scenario"),
            "steps": self.progress.get("steps", []),
            "signal": self.signal_name,
            "exit_status": self.exit_status,
            "seconds_in_step": round(self.seconds_in_step, 3),
            "where": self.where,
            "error": self.progress.get("error", ""),
            "error_frames": self.progress.get("error_frames", []),
            "call": self.progress.get("call"),
            "stall": self.progress.get("stall"),
            # Wrong data a check of the step found before the step ended (Progress.found_wrong).
            "wrong": self.progress.get("wrong"),
            # check_ep's scenarios: those finished, and in ``views`` the tensors handed as views
            # to the call it is in and what it found so far (a process that ends there may have
            # refused a view: a precondition, read by rank 0's supervisor).
            "scenario_results": self.progress.get("scenario_results"),
            "scenario_views": self.progress.get("scenario_views"),
            "scenario_found": self.progress.get("scenario_found"),
        }


def innermost_frame(fault_log: str) -> str:
    """The innermost frame of the first thread faulthandler listed, outside Python's library.

    faulthandler lists the most recent call first; a crash inside ``ctypes`` or another
    standard module is attributed to the caller that reached it.
    """
    stdlib = sysconfig.get_paths()["stdlib"]
    frames: list[str] = []
    for line in fault_log.splitlines():
        text = line.strip()
        if text.startswith("File "):
            frames.append(text)
        elif frames and not text:
            break  # the first thread's block ended
    for frame in frames:
        if stdlib not in frame:
            return frame
    return frames[0] if frames else ""


class Progress:
    """The breadcrumb the child updates; a no-op outside supervision."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.state: dict[str, Any] = {}
        #: The backend calls so far (``mark_call``, ``mark_return``), as the call file holds them.
        self._calls: dict[str, Any] = {"returned": 0}
        #: The label of the last backend call that returned ("dispatch, call #12").
        self.last_call: str | None = None

    @property
    def stopping(self) -> bool:
        """The parent is stopping this child: it must not print or write a verdict now."""
        return self.path is not None and (self.path.parent / STOP_MARKER).exists()

    def update(self, **fields: Any) -> None:
        if "current" in fields:
            fields.setdefault("started", time.time())
        self.state.update(fields)
        if self.path is not None:
            # Read by the parent on this machine: atomic is enough, no fsync (it is written
            # before every backend call of the scenarios).
            write_json_atomic(self.path, self.state, fsync=False)

    def mark_call(self, name: str, number: int) -> None:
        """This process entered its ``number``-th call into the backend, ``name``: the call
        file says which (``call``: "dispatch, call #12"), since when, and how far it got before
        (``returned``...): a supervisor holds that against its peers' (``stall.py``)."""
        self._calls.update(
            call=f"{name}, call #{number}", number=number, since=time.time(), returned=number - 1
        )
        self._write_calls()

    def mark_return(self, number: int) -> None:
        """Call ``number`` returned (or raised): the call file says so, with the slowest call
        of the step so far (a peer's bound for waiting on this rank)."""
        now = time.time()
        step = self.state.get("current")
        took = now - float(self._calls.get("since") or now)
        same_step = self._calls.get("step") == step
        slowest = float(self._calls.get("slowest") or 0.0) if same_step else 0.0
        self.last_call = self._calls.get("call")
        self._calls.update(
            call=None,
            number=None,
            since=None,
            returned=number,
            returned_at=now,
            step=step,
            slowest=round(max(slowest, took), 4),
        )
        self._write_calls()

    def found_wrong(self, detail: str) -> None:
        """A check of the current step found wrong data before the step ended (the first such
        finding of the step is kept): if the ranks then stop meeting in a collective, the report
        keeps the verdict the wrong result earned."""
        step = self.state.get("current")
        if (self.state.get("wrong") or {}).get("step") != step:
            self.update(wrong={"step": step, "detail": detail})

    def _write_calls(self) -> None:
        """The call file, beside the breadcrumb: written before and after every call into the
        backend, so it costs a few bytes, not the whole breadcrumb."""
        if self.path is None:
            return
        target = self.path.parent / CALL_FILE
        tmp = target.with_name(f".{CALL_FILE}.tmp")
        tmp.write_text(json.dumps(self._calls))
        os.replace(tmp, target)


#: The current process's breadcrumb (set in the supervised child).
progress = Progress(None)


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@dataclass
class Watch:
    """What the parent watches for besides the child itself."""

    #: Seconds a single step may run before it counts as a hang (None: no limit).
    step_deadline: float | None = None
    #: Called every poll; returns True when another rank failed and this child must stop.
    peer_failed: Callable[[], bool] = lambda: False
    #: Seconds to let the child end by itself once a peer failed (its collectives may error).
    peer_grace: float = 2.0
    #: Called with the child's breadcrumb every ``stall_every`` seconds; returns what to report
    #: when the child stopped making progress in a step its peers finished (None: it did not).
    stalled: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None
    stall_every: float = 0.5


def run_supervised(
    work: Callable[[], int], watch: Watch | None = None, who: str = "probe"
) -> Outcome:
    """Run ``work`` in a forked child and return how it ended; ``who`` begins the lines this
    process and the child print ("check_train: rank 1").

    Falls back to calling ``work`` directly where fork is unavailable or when already inside
    a supervised child.
    """
    watch = watch or Watch()
    if not hasattr(os, "fork") or os.environ.get(CHILD_ENV):
        return Outcome("finished", work())
    # A launched rank ends with what started it (_lifeline): its backend's process group and
    # this directory go with it.
    lifeline.start(who)
    tmp = Path(tempfile.mkdtemp(prefix="ep-probe-"))
    lifeline.own_path(tmp)
    crumb, fault_path = tmp / "progress.json", tmp / "fault.log"
    sys.stdout.flush()
    sys.stderr.flush()
    oom_before = _memory.oom_kills()
    pid = os.fork()
    if pid == 0:  # the child: do the work, never return into the caller
        _child(work, crumb, fault_path, who)
    with contextlib.suppress(OSError):  # the child does it too: whichever runs first
        os.setpgid(pid, pid)
    lifeline.own_group(pid)

    terminated: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: terminated.append(signum))
    try:
        how, status, seconds, state = _watch_child(pid, crumb, watch, terminated)
    except BaseException:  # Ctrl-C, or the supervisor's own failure: the backend goes too
        _kill_group(pid)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        lifeline.release_group(pid)
        shutil.rmtree(tmp, ignore_errors=True)
        lifeline.release_path(tmp)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    _kill_group(pid)  # anything the backend process started and left running
    lifeline.release_group(pid)
    if how == "ended":  # the child's last words, written after the last poll
        state = _read_state(crumb)
    outcome = _outcome(how, status, state, _read_text(fault_path), seconds)
    if outcome.signal_name == "SIGKILL" and _killed_for_memory(oom_before):
        outcome.signal_name = f"SIGKILL ({OUT_OF_MEMORY})"
    for path in (crumb, fault_path, tmp / STOP_MARKER, tmp / CALL_FILE, tmp / f".{CALL_FILE}.tmp"):
        path.unlink(missing_ok=True)
    shutil.rmtree(tmp / INDUCTOR_CACHE, ignore_errors=True)
    if not any(tmp.iterdir()):
        tmp.rmdir()
    lifeline.release_path(tmp)
    return outcome


#: How a backend process the kernel's OOM killer ended is named (with SIGKILL).
OUT_OF_MEMORY = "the kernel's out-of-memory killer"
#: The fix for it, in place of a crash's.
OUT_OF_MEMORY_HINT = (
    "the machine (or this job's memory cgroup) ran out of memory: run fewer ranks "
    "(--nproc-per-node) or a smaller shape (--tokens, --hidden), or run where more memory is "
    "free; the kernel log (dmesg) names what it ended"
)


def _killed_for_memory(before: int | None) -> bool:
    """Whether the kernel's OOM killer ended a process since ``before`` (its count then)."""
    after = _memory.oom_kills()
    return before is not None and after is not None and after > before


def _kill_group(pid: int) -> None:
    """SIGKILL the backend process's group (it and whatever it started), if any is left."""
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)


#: The directory, beside the breadcrumbs, that holds torch's inductor cache for the child when
#: none is set and none is there yet (``_inductor_cache``): removed with them.
INDUCTOR_CACHE = "torchinductor"


def _inductor_cache(tmp: Path) -> None:
    """Give torch's inductor cache a directory of this run's (removed with it), unless the
    user set one (TORCHINDUCTOR_CACHE_DIR) or its default directory is there already.

    Importing ``torch._dynamo`` (any torch.optim step, torch.utils.checkpoint) makes inductor's
    cache directory, by default ``$TMPDIR/torchinductor_<user>``: a probe run left it behind,
    empty, in a TMPDIR it had found empty. One that is there already is a cache in use: its
    kernels serve this run too.
    """
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    default = Path(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))
    if not default.exists():
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp / INDUCTOR_CACHE)


def _child(work: Callable[[], int], crumb: Path, fault_path: Path, who: str) -> None:
    code = 3
    try:
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)  # a group of its own: stopped whole, whatever it starts
        lifeline.leave_to_parent()  # the job directory's lock stays the rank's alone
        _die_with_parent()
        os.environ[CHILD_ENV] = "1"
        _inductor_cache(crumb.parent)
        progress.path = crumb
        fault_file = open(fault_path, "w")  # noqa: SIM115 - must outlive this frame
        faulthandler.enable(file=fault_file, all_threads=False)
        faulthandler.register(signal.SIGUSR1, file=fault_file, all_threads=True)
        code = work()
        progress.update(verdict=code)
    except SystemExit as exc:  # a verdict only if work() itself chose to exit
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException as exc:
        message = f"{type(exc).__name__}: {exc}"
        print(f"{who}: unexpected {message}", file=sys.stderr)
        # Where it was raised, and what this process had taken from outside its venv: the
        # supervisor, which never imported it, reports both.
        frames = _frames(exc)
        progress.update(
            error=" ".join(message.split())[:400],
            error_frames=frames[-20:],
            loaded_outside_venv=_venv_record.loaded_outside(),
        )
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _frames(exc: BaseException) -> list[str]:
    """The files of ``exc``'s traceback and of the errors it was raised from (``raise ...
    from``), innermost last: an ImportError made of an import's ``sys.exit`` names the file
    that exited."""
    files: list[str] = []
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        files.extend(frame.filename for frame in traceback.extract_tb(cause.__traceback__))
        cause = cause.__cause__
    return files


def _watch_child(
    pid: int, crumb: Path, watch: Watch, terminated: list[int]
) -> tuple[str, int, float, dict[str, Any]]:
    """Wait for the child, stopping it on a hang, a peer's failure or SIGTERM.

    Returns how it ended, its wait status, the seconds spent in its last step and, for a
    child that was stopped, its breadcrumbs as they were when the parent decided to stop it
    (stopping can interrupt a blocking call and let the child run on a little).
    """
    peer_since: float | None = None
    next_stall_check = time.monotonic() + watch.stall_every
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        state = _read_state(crumb)
        in_step = _seconds_in_step(state)
        if done:
            return "ended", status, in_step, state
        if terminated:
            return "stopped", _stop(pid, crumb, dump=False), in_step, state
        if watch.step_deadline is not None and in_step > watch.step_deadline:
            return "hang", _stop(pid, crumb, dump=True), in_step, state
        if watch.stalled is not None and time.monotonic() >= next_stall_check:
            next_stall_check = time.monotonic() + watch.stall_every
            stall = watch.stalled(state)
            if stall is not None:
                return "stall", _stop(pid, crumb, dump=True), in_step, {**state, "stall": stall}
        if peer_since is None and watch.peer_failed():
            peer_since = time.monotonic()
        if peer_since is not None and time.monotonic() - peer_since > watch.peer_grace:
            return "stopped", _stop(pid, crumb, dump=True), in_step, state
        time.sleep(POLL_SECONDS)


def _stop(pid: int, crumb: Path, dump: bool) -> int:
    """Ask the child for its stacks (when ``dump``), then kill it; return its wait status.

    The stop marker comes first: the signal that asks for the stacks can end a blocking call
    early, and the child must not then go on to print a verdict of its own.
    """
    (crumb.parent / STOP_MARKER).touch()
    if dump:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return status
            time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    _kill_group(pid)
    return os.waitpid(pid, 0)[1]


def _seconds_in_step(state: dict[str, Any]) -> float:
    started = state.get("started")
    return time.time() - started if isinstance(started, int | float) else 0.0


def _outcome(how: str, status: int, state: dict[str, Any], fault: str, seconds: float) -> Outcome:
    code = os.waitstatus_to_exitcode(status)
    if how in ("hang", "stopped", "stall"):
        return Outcome(how, 3, state, fault, seconds_in_step=seconds)
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return Outcome("signal", 3, state, fault, signal_name=name, seconds_in_step=seconds)
    if "verdict" not in state:
        how = "error" if state.get("error") else "exit"
        return Outcome(how, 3, state, fault, exit_status=code, seconds_in_step=seconds)
    return Outcome("finished", code, state, fault)


def _read_state(crumb: Path) -> dict[str, Any]:
    """The child's breadcrumb, with the backend call it is in (``call``, None between calls)
    and its calls so far (``calls``: ``Progress.mark_call``)."""
    state = _read_json(crumb)
    calls = _read_json(crumb.parent / CALL_FILE)
    state["call"] = calls.get("call") or None
    state["calls"] = calls
    return state


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
