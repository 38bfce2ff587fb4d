"""``check-ep --nproc-per-node N``: start N local ranks through torchrun's own launcher.

Why this module exists: a probe is most often run by hand on one node, where typing torchrun
is a chore, and torchrun turns every failure into exit 1 while the probe's codes (3 unusable,
4 missing, 5 skipped...) are the point. So the probe calls torchrun's launcher in-process
(``torch.distributed.launcher.elastic_launch``: same rendezvous, same environment, same
teardown as the ``torchrun`` command) and returns the code that rank 0 wrote to a file.
"""

from __future__ import annotations

import os
import sys
import tempfile
import uuid
from pathlib import Path

from ep_image import child_env
from ep_image.probes._report import EXIT_UNUSABLE

#: Where rank 0 writes the job's exit code for the launcher (set by the launcher only).
EXIT_FILE_ENV = "EP_PROBE_EXIT_FILE"


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


def launch_local(nproc: int, module: str, argv: list[str]) -> int:
    """Run ``python -m module argv`` on ``nproc`` local ranks; return rank 0's exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    fd, exit_file = tempfile.mkstemp(prefix="check_ep-exit-")
    os.close(fd)
    # As torchrun does: one intra-op thread per rank unless the user set it, so N ranks do
    # not oversubscribe the cores (set here to spare torchrun's warning about it).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ[EXIT_FILE_ENV] = exit_file
    os.environ["PYTHONPATH"] = child_env()["PYTHONPATH"]  # the ranks import this ep_image
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"check_ep-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.1,
    )
    try:
        elastic_launch(config, sys.executable)(
            "-u", "-m", module, *strip_flag(argv, "--nproc-per-node")
        )
    except ChildFailedError:
        pass  # a rank ended non-zero: rank 0's code says why
    finally:
        del os.environ[EXIT_FILE_ENV]
    try:
        text = Path(exit_file).read_text().strip()
    finally:
        Path(exit_file).unlink(missing_ok=True)
    if not text:
        print("check_ep: rank 0 ended without a verdict", file=sys.stderr)
        return EXIT_UNUSABLE
    return int(text)
