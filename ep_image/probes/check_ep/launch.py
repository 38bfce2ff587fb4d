"""``check-ep --nproc-per-node N``: start N local ranks through torchrun's own launcher.

Why this module exists: a probe is most often run by hand on one node, where typing torchrun
is a chore, and torchrun turns every failure into exit 1 while the probe's codes (3 unusable,
4 missing, 5 skipped...) are the point. So the probe calls torchrun's launcher in-process
(``torch.distributed.launcher.elastic_launch``: same rendezvous, same environment, same
teardown as the ``torchrun`` command) and returns the code that rank 0 wrote to a file.
Everything the job writes in TMPDIR (torchelastic's logs, the ranks' own temporary files) goes
into one job directory that the launcher removes, or, if it is killed, the last rank out
(``ep_image/probes/_lifeline.py``); a job that cannot fit in memory is refused first.
"""

from __future__ import annotations

import fcntl
import os
import sys
import tempfile
import uuid
from pathlib import Path

from ep_image import child_env, cli
from ep_image.probes import _lifeline, _memory
from ep_image.probes._report import EXIT_UNUSABLE

#: Where rank 0 writes the job's exit code for the launcher (set by the launcher only).
EXIT_FILE_ENV = "EP_PROBE_EXIT_FILE"
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


def launch_local(nproc: int, module: str, argv: list[str]) -> int:
    """Run ``python -m module argv`` on ``nproc`` local ranks; return rank 0's exit code."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    check_memory(nproc)
    job = tempfile.mkdtemp(prefix="ep-probe-job-")
    exit_file = os.path.join(job, "exit-code")
    # What the ranks inherit: set here, put back when the job ends.
    settings = {
        EXIT_FILE_ENV: exit_file,
        _lifeline.JOB_DIR_ENV: job,
        _lifeline.LAUNCHER_PID_ENV: str(os.getpid()),
        "TMPDIR": job,  # the ranks' temporary files go with the job's directory
        "PYTHONPATH": child_env()["PYTHONPATH"],  # the ranks import this ep_image
    }
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    # As torchrun does: one intra-op thread per rank unless the user set it, so N ranks do
    # not oversubscribe the cores (set here to spare torchrun's warning about it).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    held = _lifeline.hold_job_dir(fcntl.LOCK_SH, job)
    oom_before = _memory.oom_kills()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"check_ep-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.1,
        logs_specs=DefaultLogsSpecs(log_dir=os.path.join(job, "torchelastic")),
    )
    try:
        elastic_launch(config, sys.executable)(
            "-u", "-m", module, *strip_flag(argv, "--nproc-per-node")
        )
    except ChildFailedError:
        pass  # a rank ended non-zero: rank 0's code says why
    finally:
        try:
            text = Path(exit_file).read_text().strip() if os.path.exists(exit_file) else ""
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            _lifeline.leave_job_dir(held, job)
    if not text:
        oom_after = _memory.oom_kills()
        said = "check_ep: rank 0 ended without a verdict"
        if oom_before is not None and oom_after is not None and oom_after > oom_before:
            said += (
                f": the kernel's out-of-memory killer ended {oom_after - oom_before} process(es) "
                "meanwhile; run fewer ranks (--nproc-per-node) or a smaller shape"
            )
        print(said, file=sys.stderr)
        return EXIT_UNUSABLE
    return int(text)
