"""What a rank probe can refuse before any rank starts: a python without torch, and (for the local
launcher) a layer shape or device the ranks would refuse anyway.

Why this module exists: the ranks find these too, but only after they started: a python without
torch ended as "unusable (exit 3)" with the fix of a lost collective, and ``--nproc-per-node 64``
on a 2-core machine started 64 ranks (160 s) before saying that 32 experts do not split over
them. Found here, the first is a verdict naming the python to use, the second one usage line.
"""

from __future__ import annotations

import importlib.util
import platform
import sys

from ep_image import backends, cli
from ep_image.probes._ranks.runtime import decide_placement
from ep_image.probes._ranks.types import ProbeKind, RunOptions
from ep_image.probes._report import Status, Step


def torch_missing(kind: ProbeKind) -> Step | None:
    """The import step's verdict when this python cannot import torch (None when it can);
    found from the import system alone, without importing torch."""
    if importlib.util.find_spec("torch") is not None:
        return None
    here = f"{sys.executable}, Python {platform.python_version()}"
    return Step(
        "import",
        Status.MISSING,
        detail=f"torch is not installed in this python ({here}): the probe runs on torch",
        hint="run it with the python of an environment that holds the project: a venv made by "
        f"scripts/make_venv.py (venvs/{backends.DEFAULT_BACKEND}/bin/python {kind.front_door}), "
        f"the image's python, or uv run {kind.front_door} after uv sync --extra "
        f"{backends.DEFAULT_BACKEND}",
    )


def visible_gpus() -> int:
    """GPUs this process sees, as a rank counts them (torch is imported: the launcher needs it
    anyway)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_local_launch(kind: ProbeKind, options: RunOptions, gpus: int) -> None:
    """Raise ``cli.UsageError`` for what the ``--nproc-per-node`` ranks would refuse: the
    layer shape on the device they will get (its defaults follow the device), and
    ``--device cuda`` without a GPU.

    Every local rank sees the same ``gpus``; placement is decided as the ranks decide it
    (``runtime.decide_placement``), so a shape refused here is one they would refuse too.
    """
    nproc = options.nproc_per_node
    if options.device == "cuda" and gpus == 0:
        raise cli.UsageError("--device cuda but no GPU is visible; use --device cpu")
    on_gpu = False
    if options.device != "cpu" and gpus > 0:
        facts = [
            {"rank": r, "host": "local", "gpus": gpus, "index": r % gpus, "uuid": str(r % gpus)}
            for r in range(nproc)
        ]
        on_gpu = decide_placement(facts, 0, True, options.ranks_per_gpu).use_gpu
    kind.sizes(options, on_gpu, nproc)
