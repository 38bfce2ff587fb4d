"""The backend process of one rank: import torch and the backend, place the rank, build the
process groups, run the steps, and (on rank 0) write the verdict.

Why this module exists: this is the process the supervisor forks and watches, and the only part
of the rank machinery that brings torch in; a usage error found only here (a GPU backend with
``--device cpu``, NCCL communicators on a shared GPU) is still one line and exit 2. A rank whose
backend raised while its peers were left blocked in a collective ends at once, leaving what it
found in its breadcrumbs for the supervisors to report (``runtime.PeersLeftWaiting``).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ep_image import cli
from ep_image.probes import _supervise
from ep_image.probes._adapters.base import Shape
from ep_image.probes._ranks import output
from ep_image.probes._ranks.calls import track_calls
from ep_image.probes._ranks.runtime import (
    PeersLeftWaiting,
    RankEnv,
    agree_code,
    connect_store,
    decide_placement,
    device_facts,
    exchange,
    init_distributed,
    topology,
)
from ep_image.probes._ranks.steps import run_steps
from ep_image.probes._ranks.types import ProbeKind, RunOptions, Selection
from ep_image.probes._report import EXIT_UNUSABLE, EXIT_USAGE, Step, exit_code_of

if TYPE_CHECKING:
    from ep_image.probes._adapters.base import EPBackend


def work(kind: ProbeKind, options: RunOptions, env: RankEnv, sel: Selection) -> int:
    """The supervised child: bad usage is still one line and exit 2 here."""
    try:
        return run_worker(kind, options, env, sel)
    except cli.UsageError as exc:
        if env.rank == 0:
            print(f"{kind.prog}: usage error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except PeersLeftWaiting as exc:
        # No merged verdict can come: the supervisors stop the blocked peers and rank 0's
        # reports this rank's step (supervisor.py reads "raised").
        _supervise.progress.update(
            raised={**exc.step.to_json(), "waiting": exc.waiting}, current=exc.step.name
        )
        return EXIT_UNUSABLE


@contextlib.contextmanager
def importing(what: str) -> Iterator[None]:
    """An import that ends the process (``sys.exit`` in a module, a fake ``torch`` on
    PYTHONPATH) is the import failing, said as such, not the backend ending its process: an
    ImportError, whose cause's frames name the file (``import_failure``)."""
    try:
        yield
    except SystemExit as exc:
        raise ImportError(f"importing {what} called sys.exit({exc.code!r})") from exc


def run_worker(kind: ProbeKind, options: RunOptions, env: RankEnv, sel: Selection) -> int:
    """Import torch and the backend, place the rank, set up the groups, run the steps, report."""
    _supervise.progress.update(backend=sel.name, current="import", steps=[])
    # The torch side of the probe is imported from here on only (the adapters here, what each
    # step runs when it runs): the command line and the supervisor never load torch themselves.
    with importing("torch"):
        import torch

    from ep_image.probes._adapters import plugins

    if options.backend_class:
        with importing(f"--backend-class {options.backend_class}"):
            backend_cls = plugins.load_backend_class(options.backend_class)
    else:
        backend_cls = plugins.BUILTIN[sel.name]
    if sel.custom:
        sel.name = backend_cls.name
    backend = track_calls(backend_cls())
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0  # this rank's view
    if backend.requires_gpu:
        if options.device == "cpu":
            raise cli.UsageError(
                f"{backend.name} runs on GPUs only; drop --device cpu or use --backend torch"
            )
        wants_gpu = True
    elif options.device == "cuda":
        if gpus == 0:
            raise cli.UsageError("--device cuda but no GPU is visible; use --device cpu")
        wants_gpu = True
    else:
        wants_gpu = options.device == "auto" and gpus > 0
    store = connect_store(env, options.timeout)
    facts = exchange(env, store, "place", device_facts(env, wants_gpu), options.timeout)
    placement = decide_placement(facts, env.rank, wants_gpu, options.ranks_per_gpu)
    try:
        layout = topology(facts)
    except ValueError as exc:
        raise cli.UsageError(str(exc)) from None
    if placement.shared and backend.needs_nccl_group:
        raise cli.UsageError(
            f"{backend.name} builds NCCL communicators, and NCCL refuses two ranks on one GPU: "
            "run one rank per GPU (drop --ranks-per-gpu, or start at most as many ranks as "
            "GPUs)"
        )
    # The shape of the device the rank actually got: a GPU backend on a machine without one
    # runs (and is reported) on the CPU shape.
    sizes = kind.sizes(options, placement.use_gpu, env.world)
    dtype_name = options.dtype
    if dtype_name == "auto":
        dtype_name = kind.default_dtype(backend.requires_gpu or wants_gpu)
    if dtype_name not in backend.dtypes:
        raise cli.UsageError(
            f"{backend.name} dispatches {', '.join(backend.dtypes)} only, not {dtype_name}"
        )

    rt = init_distributed(env, placement, options.timeout, store)
    rt.node_of_rank = [r["node"] for r in layout["ranks"]]
    layer = {k: sizes[k] for k in ("tokens", "hidden", "experts", "topk")}
    shape = Shape(dtype=getattr(torch, dtype_name), device=rt.device, **layer)
    meta = {
        "device": str(rt.device),
        "dtype": dtype_name,
        "shape": sizes,
        "seed": options.seed,
        **kind.meta(options, sizes),
        "ranks_per_gpu": placement.ranks_per_gpu,
        "shared_gpu": placement.shared,
        "process_group": placement.group_backend,
        "topology": layout,
    }
    _supervise.progress.update(backend=sel.name, meta=meta)
    run = kind.run_type(
        rt=rt, sel=sel, backend=backend, shape=shape, sizes=dict(sizes), options=options
    )
    steps: list[Step] = []
    try:
        steps = run_steps(kind.steps, run)
    except PeersLeftWaiting:
        raise  # no destroy: it may wait for the blocked peers too
    except BaseException:
        _destroy(backend, env, kind.prog)
        raise
    _destroy(backend, env, kind.prog)
    code = agree_code(rt, exit_code_of(steps, options.require, kind.judged))
    try:
        return output.finish(kind, options, env, sel, steps, meta, code)
    finally:
        import torch.distributed as dist

        dist.barrier(group=rt.ctrl_group)
        dist.destroy_process_group()


def _destroy(backend: EPBackend, env: RankEnv, prog: str) -> None:
    """Release the backend's buffer; a failing destroy must not hide the verdict."""
    try:
        backend.destroy()
    except Exception as exc:
        print(f"{prog}: rank {env.rank}: backend destroy failed: {exc}", file=sys.stderr)
