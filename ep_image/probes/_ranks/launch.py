"""``check-ep --nproc-per-node N`` (and check-train's): start N local ranks through torchrun's
own launcher.

Why this module exists: a probe is most often run by hand on one node, where typing torchrun
is a chore, and torchrun turns every failure into exit 1 while the probe's codes (3 unusable,
4 missing, 5 skipped...) are the point. So the probe calls torchrun's launcher in-process
(``torch.distributed.launcher.elastic_launch``: same rendezvous, same environment, same
teardown as the ``torchrun`` command) and returns the code that rank 0 wrote to a file.
Everything the job writes in TMPDIR (torchelastic's logs, the ranks' own temporary files) goes
into one job directory that the launcher removes, or, if it is killed, the last rank out
(``ep_image/probes/_lifeline.py``); a job that cannot fit in memory is refused first. Ctrl-C or
SIGTERM of the launcher (torchelastic's agent would raise its ``SignalException`` through here
as a traceback) stops the ranks, which end without a verdict of their own, and ends in one line
and the conventional 128 + the signal.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from ep_image import child_env, cli
from ep_image.probes import _lifeline, _memory
from ep_image.probes._report import EXIT_UNUSABLE

#: Where rank 0 writes the job's exit code for the launcher (set by the launcher only).
EXIT_FILE_ENV = "EP_PROBE_EXIT_FILE"
#: What the launcher leaves in the job's directory, before it stops the ranks, when a signal
#: interrupted it: the signal's name. A rank stopped then has no verdict to give.
INTERRUPTED_FILE = "interrupted"
#: The signals the launcher takes itself: each stops the job without a verdict.
INTERRUPTS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: The signals torchelastic's agent keeps (``LaunchConfig.signals_to_handle``, which it puts in
#: this variable of the launcher's environment).
AGENT_SIGNALS = "SIGQUIT"
_AGENT_SIGNALS_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"
#: A rank's memory, in units of what this launcher holds of its own after importing torch: its
#: supervisor is a Python that imports torch as this one did, and its backend process is a fork
#: of it that shares its pages until it writes them. Measured: 372 MiB per rank at the peak of a
#: run of the torch backend at the CPU shape (4 ranks, every step), this launcher 295 MiB.
RANK_FACTOR = 1.25


def strip_flag(argv: list[str], flag: str) -> list[str]:
    """``argv`` without ``flag VALUE`` / ``flag=VALUE``."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
            continue
        if item == flag:
            skip = True
            continue
        if item.startswith(flag + "="):
            continue
        out.append(item)
    return out


def write_exit_code(code: int) -> None:
    """Rank 0: leave the job's code where the launcher looks for it."""
    path = os.environ.get(EXIT_FILE_ENV)
    if path:
        Path(path).write_text(f"{code}\n")


def interrupted() -> str | None:
    """In a rank of the probe's launcher: the name of the signal that interrupted the launcher
    (None when it was not, or outside such a job)."""
    job = os.environ.get(_lifeline.JOB_DIR_ENV)
    if not job:
        return None
    try:
        return Path(job, INTERRUPTED_FILE).read_text().strip() or None
    except OSError:
        return None


def interrupted_code(name: str) -> int:
    """The conventional exit status of a process a signal named ``name`` interrupted."""
    try:
        return 128 + signal.Signals[name].value
    except KeyError:
        return 128 + signal.SIGTERM.value


def _quiet_agent() -> dict[str, int]:
    """Silence torchelastic's warnings while it stops the ranks of an interrupted job (its
    "Received 15 death signal", "Sending process ... closing signal"): the launcher says it in
    one line. Returns the levels to put back."""
    levels: dict[str, int] = {}
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if name.startswith("torch.distributed.elastic") and isinstance(logger, logging.Logger):
            levels[name] = logger.level
            logger.setLevel(logging.ERROR)
    return levels


def check_memory(nproc: int) -> None:
    """cli.UsageError when ``nproc`` ranks cannot fit in the memory this process (and its
    children) may still use: each rank needs about RANK_FACTOR times what this process holds
    of its own, the layer's tensors beyond the CPU shape's on top."""
    own = _memory.own_anonymous()
    free, source = _memory.available()
    if own <= 0 or free <= 0:
        return  # not measurable here: nothing to refuse on
    per_rank = int(RANK_FACTOR * own)
    needed = nproc * per_rank
    if needed > free:
        fits = max(1, free // per_rank)
        raise cli.UsageError(
            f"--nproc-per-node {nproc} needs about {needed / 2**30:.1f} GiB ({nproc} ranks x "
            f"{per_rank / 2**20:.0f} MiB: a rank's supervisor and its backend process, which "
            f"import torch as this process did, {own / 2**20:.0f} MiB here), and {source} "
            f"leaves {free / 2**30:.1f} GiB: started, the kernel's out-of-memory killer would "
            f"end them one by one; run at most {fits} ranks here, or where more memory is free"
        )


class _Interrupt:
    """The launcher's own handler of ``INTERRUPTS`` while a job runs: the first one marks the
    job interrupted (its ranks then end quietly) and raises as torchelastic's handler does, so
    that its agent stops the ranks (SIGTERM); later ones wait for that to finish."""

    def __init__(self, prog: str) -> None:
        self.prog = prog
        self.job: str | None = None
        self.got: list[signal.Signals] = []
        self.stopping = False
        self._previous: dict[int, Any] = {}
        self._levels: dict[str, int] = {}

    def install(self) -> None:
        """Take ``INTERRUPTS``, except those this process was started ignoring (``nohup``'s
        SIGHUP, SIGINT of a background job): those stay ignored."""
        for sig in INTERRUPTS:
            if signal.getsignal(sig) != signal.SIG_IGN:
                self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        for name, level in self._levels.items():
            logging.getLogger(name).setLevel(level)

    def _handle(self, signum: int, _frame: object) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        self.got.append(signal.Signals(signum))
        if len(self.got) > 1 or self.stopping:
            return  # the job is being stopped already: let that finish
        if self.job is not None:
            with contextlib.suppress(OSError):
                Path(self.job, INTERRUPTED_FILE).write_text(self.got[0].name)
        self._levels.update(_quiet_agent())
        raise SignalException(f"{self.prog} got {self.got[0].name}", sigval=signal.SIGTERM)


def launch_local(nproc: int, module: str, argv: list[str], prog: str) -> int:
    """Run ``python -m module argv`` on ``nproc`` local ranks; return rank 0's exit code, or
    128 + the signal when SIGINT, SIGTERM or SIGHUP interrupted the job (``prog`` says so)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    check_memory(nproc)
    stop = _Interrupt(prog)
    stop.install()
    job: str | None = None
    held: int | None = None
    saved: dict[str, str | None] = {}
    text = ""
    oom_before = _memory.oom_kills()
    try:
        try:
            job = tempfile.mkdtemp(prefix="ep-probe-job-")
            stop.job = job
            # What the ranks inherit: set here, put back when the job ends.
            settings = {
                EXIT_FILE_ENV: os.path.join(job, "exit-code"),
                _lifeline.JOB_DIR_ENV: job,
                _lifeline.LAUNCHER_PID_ENV: str(os.getpid()),
                "TMPDIR": job,  # the ranks' temporary files go with the job's directory
                "PYTHONPATH": child_env()["PYTHONPATH"],  # the ranks import this ep_image
                _AGENT_SIGNALS_ENV: AGENT_SIGNALS,  # the agent sets it: put back after
            }
            saved = {name: os.environ.get(name) for name in settings}
            os.environ.update(settings)
            # As torchrun does: one intra-op thread per rank unless the user set it, so N ranks
            # do not oversubscribe the cores (set here to spare torchrun's warning about it).
            os.environ.setdefault("OMP_NUM_THREADS", "1")
            held = _lifeline.hold_job_dir(fcntl.LOCK_SH, job)
            config = LaunchConfig(
                min_nodes=1,
                max_nodes=1,
                nproc_per_node=nproc,
                run_id=f"{prog}-{uuid.uuid4().hex[:8]}",
                rdzv_backend="c10d",
                rdzv_endpoint="localhost:0",
                max_restarts=0,
                monitor_interval=0.1,
                logs_specs=DefaultLogsSpecs(log_dir=os.path.join(job, "torchelastic")),
            )
            if hasattr(config, "signals_to_handle"):  # the agent leaves INTERRUPTS to us
                config.signals_to_handle = AGENT_SIGNALS
            elastic_launch(config, sys.executable)(
                "-u", "-m", module, *strip_flag(argv, "--nproc-per-node")
            )
        except ChildFailedError:
            pass  # a rank ended non-zero: rank 0's code says why
    except SignalException as exc:  # interrupted: the agent has stopped the ranks
        if not stop.got:  # a torch whose agent took the signal itself
            stop.got.append(signal.Signals(exc.sigval))
    finally:
        stop.stopping = True
        try:
            exit_file = os.path.join(job, "exit-code") if job else ""
            text = Path(exit_file).read_text().strip() if os.path.isfile(exit_file) else ""
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            if job is not None:
                _lifeline.leave_job_dir(held, job)
            stop.uninstall()
    if stop.got:
        said = f"{prog}: interrupted ({stop.got[0].name}): ranks stopped, no verdict"
        print(said, file=sys.stderr)
        return 128 + stop.got[0].value
    if not text:
        oom_after = _memory.oom_kills()
        said = f"{prog}: rank 0 ended without a verdict"
        if oom_before is not None and oom_after is not None and oom_after > oom_before:
            said += (
                f": the kernel's out-of-memory killer ended {oom_after - oom_before} process(es) "
                "meanwhile; run fewer ranks (--nproc-per-node) or a smaller shape"
            )
        print(said, file=sys.stderr)
        return EXIT_UNUSABLE
    return int(text)
