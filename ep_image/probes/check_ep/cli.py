"""check_ep: prove that an expert-parallel (EP) backend works, not just that it imports.

Drives the backend as an MoE layer does, on the real process group, and checks every result
against a reference computed in plain torch; the ``_ep_*`` modules beside it hold the parts.
See docs/probes.md, section "check-ep".
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ep_image.probes import _backend_detect, _supervise
from ep_image.probes._report import (
    EXIT_USAGE,
    ProbeArgumentParser,
    Status,
    Step,
    UsageError,
    exit_code_of,
)
from ep_image.probes.check_ep import launch, output, scenarios
from ep_image.probes.check_ep.board import Board
from ep_image.probes.check_ep.ranks import (
    RankEnv,
    agree_code,
    connect_store,
    decide_placement,
    device_facts,
    exchange,
    init_distributed,
    topology,
)
from ep_image.probes.check_ep.steps import STEP_NAMES, not_run, run_steps

PROG = "check_ep"
#: What the ranks of --nproc-per-node run: ``python -m MODULE`` (the package's __main__).
MODULE = "ep_image.probes.check_ep"
BACKEND_CHOICES = ("auto", *_backend_detect.BACKEND_NAMES, _backend_detect.REFERENCE_BACKEND)

#: Default layer shape: a DeepSeek-V3-like MoE layer on GPU, a small one on CPU.
GPU_DEFAULTS = {"tokens": 4096, "hidden": 7168, "experts": 256, "topk": 8}
CPU_DEFAULTS = {"tokens": 256, "hidden": 512, "experts": 32, "topk": 4}


# ------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ProbeArgumentParser(
        prog="check_ep.py",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Prove that an expert-parallel backend works on this machine: build its buffer, "
            "run dispatch and combine on random MoE routing and on the routing training "
            "produces (scenarios), and check counts, payloads, the combined sum, each "
            "gradient, the outputs' dtype and layout, replay determinism and bandwidth "
            "against a plain-torch reference."
        ),
        epilog="""\
how to run:
  check-ep                                 one rank (DeepEP v1 needs 2+)
  torchrun --nproc-per-node 8 ep_image/probes/check_ep.py --json out.json
  check-ep --nproc-per-node 4 --backend torch   starts 4 local ranks itself
  check-ep --nproc-per-node 2 --ranks-per-gpu 2
                                                            2 ranks sharing 1 GPU (functional)
  check-ep --scenarios uneven --seed 3     one scenario, reproduced

scenarios (--scenarios): changing, skewed, dropped, uneven, reuse; see docs/probes.md

exit codes (all ranks agree):
  0 all passed   1 a check failed (wrong numbers)   2 bad usage
  3 backend unusable (imports, fails at run time)   4 backend missing
  5 this environment cannot run it (skipped; --require turns it into 1)

under torchrun, torchrun itself exits 1 for any non-zero code; the probe's own code is in
the table's last line and in the JSON report's exit_code.
""",
    )
    parser.add_argument(
        "--backend",
        default="auto",
        metavar="NAME",
        help=f"backend to check: auto, {', '.join(_backend_detect.BACKEND_NAMES)} or torch (the "
        "built-in all_gather reference). auto picks the one installed here, torch if none "
        "(default: auto)",
    )
    parser.add_argument(
        "--backend-class",
        metavar="FILE.py:Class",
        help="check an EPBackend subclass from a file or module instead (FILE.py:Class or "
        "package.module:Class); used by the tests to inject broken backends",
    )
    shape = parser.add_argument_group(
        "layer shape (defaults: GPU 4096/7168/256/8, CPU 256/512/32/4)"
    )
    shape.add_argument("--tokens", type=int, help="tokens per rank")
    shape.add_argument("--hidden", type=int, help="hidden size of a token")
    shape.add_argument("--experts", type=int, help="experts over all ranks (divisible by ranks)")
    shape.add_argument("--topk", type=int, help="experts per token (<= experts)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "bfloat16", "float32", "float16"),
        help="token dtype; auto: bfloat16 on GPU, float32 on CPU. DeepEP backends take "
        "bfloat16 only (default: auto)",
    )
    parser.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cuda", "cpu"),
        help="where the torch backend runs; auto: cuda when a GPU is visible. DeepEP backends "
        "always need cuda (default: auto)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="random seed; every scenario's own seed derives from it (default: 0)",
    )
    parser.add_argument(
        "--scenarios",
        default="all",
        metavar="LIST",
        help="scenarios to run after the layer-shape checks: all, none, or a comma list of "
        f"{', '.join(scenarios.NAMES)} (default: all)",
    )
    parser.add_argument(
        "--replays",
        type=int,
        default=3,
        help="extra dispatches of the same routing for the replay check (default: 3)",
    )
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations (default: 5)")
    parser.add_argument("--iters", type=int, default=20, help="timed iterations (default: 20)")
    parser.add_argument(
        "--tolerance",
        type=float,
        help="largest relative difference accepted for combine and gradients "
        "(default: 5e-6 for float32, 1e-2 for bfloat16/float16)",
    )
    parser.add_argument(
        "--min-gbs",
        type=float,
        default=0.0,
        help="fail when dispatch or combine is slower than this many GB/s (default: 0, off)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds before a stuck collective is abandoned (default: 300)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the machine-readable report here")
    parser.add_argument(
        "--require",
        action="store_true",
        help="treat 'cannot run here' (exit 5) as a failure (exit 1): for CI on GPU runners",
    )
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=0,
        metavar="N",
        help="start N local ranks (no torchrun needed) and exit with their agreed code",
    )
    parser.add_argument(
        "--ranks-per-gpu",
        type=int,
        default=1,
        metavar="K",
        help="let up to K local ranks share one GPU (round-robin) for a functional check on "
        "fewer GPUs: the group is gloo (NCCL refuses two ranks on one GPU, so backends that "
        "build NCCL communicators are refused), and bandwidth is labelled 'shared GPU: not "
        "a link figure' and never gated by --min-gbs (default: 1)",
    )
    return parser.parse_args(argv)


def validate_static(args: argparse.Namespace, world: int) -> None:
    """Flag checks that need no torch: positive sizes, top-k vs experts, divisibility."""
    if args.backend not in BACKEND_CHOICES:
        raise UsageError(
            f"unknown backend {args.backend!r}; choose one of {', '.join(BACKEND_CHOICES)}"
        )
    if args.backend_class and args.backend != "auto":
        raise UsageError("--backend-class replaces --backend; pass only one of them")
    if args.backend_class:
        target = args.backend_class.rpartition(":")[0]
        if (target.endswith(".py") or "/" in target) and not Path(target).is_file():
            raise UsageError(f"--backend-class: file not found: {target}")
    for name in ("tokens", "hidden", "experts", "topk"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise UsageError(f"--{name} must be a positive integer, got {value}")
    for name in ("replays", "iters"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise UsageError(f"--warmup must be >= 0, got {args.warmup}")
    if args.timeout <= 0:
        raise UsageError(f"--timeout must be positive, got {args.timeout}")
    if args.tolerance is not None and args.tolerance <= 0:
        raise UsageError(f"--tolerance must be positive, got {args.tolerance}")
    if args.nproc_per_node < 0:
        raise UsageError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    if args.ranks_per_gpu < 1:
        raise UsageError(f"--ranks-per-gpu must be >= 1, got {args.ranks_per_gpu}")
    try:
        args.scenario_names = scenarios.parse(args.scenarios)
    except ValueError as exc:
        raise UsageError(f"--scenarios: {exc}") from None
    validate_shape(args.tokens, args.hidden, args.experts, args.topk, world)


def validate_shape(
    tokens: int | None, hidden: int | None, experts: int | None, topk: int | None, world: int
) -> None:
    """The layer shape must be routable: top-k <= experts, experts split evenly over ranks."""
    from_ref_limits = (65536, 3, 256)  # token ids, id columns, ranks (see _ep_reference)
    if topk is not None and experts is not None and topk > experts:
        raise UsageError(f"--topk {topk} is larger than --experts {experts}")
    if experts is not None and experts % world != 0:
        raise UsageError(
            f"--experts {experts} is not divisible by the world size {world}: every rank "
            "must own the same number of experts"
        )
    if tokens is not None and tokens > from_ref_limits[0]:
        raise UsageError(f"--tokens {tokens} is above the probe's limit of 65536 per rank")
    if hidden is not None and hidden < 8:
        raise UsageError(f"--hidden {hidden} is too small: the probe needs at least 8 columns")
    if world > from_ref_limits[2]:
        raise UsageError(f"world size {world} is above the probe's limit of 256 ranks")


# ------------------------------------------------------------------------------------------
# Backend selection (before torch is imported, so "missing" answers fast)
# ------------------------------------------------------------------------------------------


@dataclass
class Selection:
    """Which backend to check and why; ``verdict`` is set when nothing can run."""

    name: str
    how: str
    installed: _backend_detect.Installed | None
    verdict: Step | None = None
    custom: bool = False


def select_backend(args: argparse.Namespace) -> Selection:
    """Resolve --backend against what is installed; a requested-but-absent one is MISSING."""
    if args.backend_class:
        return Selection("custom", f"--backend-class {args.backend_class}", None, custom=True)
    if args.backend == "torch":
        return Selection("torch", "requested", None)
    installed = _backend_detect.detect_installed()
    if args.backend == "auto":
        if installed.module_dir is None:
            return Selection(
                "torch", "auto: no deep_ep installed, using the torch reference", installed
            )
        if installed.backend is None:
            step = Step(
                "import",
                Status.ERROR,
                detail=f"auto: {installed.reason}",
                hint=f"install one of {', '.join(_backend_detect.BACKEND_NAMES)}, or pass "
                "--backend torch",
            )
            return Selection("unknown", "auto", installed, step)
        return Selection(installed.backend, f"auto: {installed.reason}", installed)
    if installed.backend == args.backend:
        return Selection(args.backend, f"requested; {installed.reason}", installed)
    if installed.module_dir is None:
        detail = f"{args.backend} requested but not installed: {installed.reason}"
    else:
        detail = (
            f"{args.backend} requested but this environment holds "
            f"{installed.backend or 'an unknown deep_ep'} ({installed.reason})"
        )
    step = Step(
        "import", Status.MISSING, detail=detail, hint=_backend_detect.INSTALL_HINTS[args.backend]
    )
    return Selection(args.backend, "requested", installed, step)


# ------------------------------------------------------------------------------------------
# Orchestration
# ------------------------------------------------------------------------------------------


def resolve_shape(args: argparse.Namespace, on_gpu: bool, world: int) -> dict[str, int]:
    defaults = GPU_DEFAULTS if on_gpu else CPU_DEFAULTS
    sizes = {
        k: getattr(args, k) if getattr(args, k) is not None else v for k, v in defaults.items()
    }
    validate_shape(sizes["tokens"], sizes["hidden"], sizes["experts"], sizes["topk"], world)
    return sizes


def run(args: argparse.Namespace, argv: list[str]) -> int:
    env = RankEnv.from_environ()
    if args.nproc_per_node:
        if env.launched:
            raise UsageError("--nproc-per-node cannot be used under torchrun; pass one of them")
        validate_static(args, args.nproc_per_node)
        return launch.launch_local(args.nproc_per_node, MODULE, argv)
    validate_static(args, env.world)
    code = supervise(args, env)
    if env.rank == 0:
        launch.write_exit_code(code)
    return code


def supervise(args: argparse.Namespace, env: RankEnv) -> int:
    """Run the backend in a watched child; report a crash, early exit or hang as exit 3."""
    sel = select_backend(args)
    if sel.verdict is not None:
        steps = [sel.verdict] + [not_run(n, sel.verdict) for n in STEP_NAMES[1:]]
        return output.finish(args, env, sel, steps, {}, exit_code_of(steps, args.require))

    if env.launched:
        # This process talks to the job's store (torch's TCPStore): import torch once, before
        # the fork, so the backend process inherits it instead of importing it again (no CUDA
        # is touched here, so the fork stays safe).
        import torch.distributed  # noqa: F401
    serve = Board.must_serve(env.rank, env.world)
    board_box: list[Board | None] = []

    def peer_failed() -> bool:
        if not board_box:  # joined lazily: the store may come up after the child starts
            board_box.append(Board.connect(env.rank, env.world, serve, args.timeout))
        board = board_box[0]
        return board is not None and board.failures() > 0

    watch = _supervise.Watch(step_deadline=args.timeout, peer_failed=peer_failed)
    outcome = _supervise.run_supervised(lambda: _worker(args, env, sel), watch)
    if env.world > 1 and not board_box:
        board_box.append(Board.connect(env.rank, env.world, serve, args.timeout))
    board = board_box[0] if board_box else None
    posted = {**outcome.to_json(), "time": time.time()}
    if board is not None:
        board.post(posted)
    if outcome.how == "finished":
        if board is not None and env.rank == 0 and serve:
            board.read(wait=10.0)  # keep serving the store until every rank is done with it
        return outcome.code
    if env.rank != 0:
        if outcome.how != "stopped":
            if outcome.fault_log:
                print(outcome.fault_log.rstrip(), file=sys.stderr)
            print(f"{PROG}: rank {env.rank}: {outcome.how} during {outcome.step}", file=sys.stderr)
        return outcome.code
    outcomes = board.read(wait=5.0) if board is not None else {}
    outcomes[env.rank] = posted
    return output.report_unfinished(args, env, sel, outcome, outcomes)


def _worker(args: argparse.Namespace, env: RankEnv, sel: Selection) -> int:
    """The supervised child: bad usage is still one line and exit 2 here."""
    try:
        return run_worker(args, env, sel)
    except UsageError as exc:
        if env.rank == 0:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


def run_worker(args: argparse.Namespace, env: RankEnv, sel: Selection) -> int:
    """Import torch and the backend, place the rank, set up the groups, run the steps, report."""
    _supervise.progress.update(backend=sel.name, current="import", steps=[])
    import torch

    from ep_image.probes.check_ep import adapters

    backend_cls = (
        adapters.load_backend_class(args.backend_class)
        if args.backend_class
        else adapters.BUILTIN[sel.name]
    )
    if sel.custom:
        sel.name = backend_cls.name
    backend = backend_cls()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0  # this rank's view
    if backend.requires_gpu:
        if args.device == "cpu":
            raise UsageError(
                f"{backend.name} runs on GPUs only; drop --device cpu or use --backend torch"
            )
        wants_gpu = True
    elif args.device == "cuda":
        if gpus == 0:
            raise UsageError("--device cuda but no GPU is visible; use --device cpu")
        wants_gpu = True
    else:
        wants_gpu = args.device == "auto" and gpus > 0
    store = connect_store(env, args.timeout)
    facts = exchange(env, store, "place", device_facts(env, wants_gpu), args.timeout)
    placement = decide_placement(facts, env.rank, wants_gpu, args.ranks_per_gpu)
    try:
        layout = topology(facts)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if placement.shared and backend.needs_nccl_group:
        raise UsageError(
            f"{backend.name} builds NCCL communicators, and NCCL refuses two ranks on one GPU: "
            "run one rank per GPU (drop --ranks-per-gpu, or start at most as many ranks as "
            "GPUs)"
        )
    # The shape of the device the rank actually got: a GPU backend on a machine without one
    # runs (and is reported) on the CPU shape.
    sizes = resolve_shape(args, placement.use_gpu, env.world)
    dtype_name = args.dtype
    if dtype_name == "auto":
        dtype_name = "bfloat16" if backend.requires_gpu or wants_gpu else "float32"
    if dtype_name not in backend.dtypes:
        raise UsageError(
            f"{backend.name} dispatches {', '.join(backend.dtypes)} only, not {dtype_name}"
        )

    rt = init_distributed(env, placement, args.timeout, store)
    rt.node_of_rank = [r["node"] for r in layout["ranks"]]
    shape = adapters.Shape(dtype=getattr(torch, dtype_name), device=rt.device, **sizes)
    meta = {
        "device": str(rt.device),
        "dtype": dtype_name,
        "shape": sizes,
        "seed": args.seed,
        "scenarios": {
            "selected": args.scenario_names,
            "tokens_per_rank": min(sizes["tokens"], scenarios.SCENARIO_TOKENS),
            "seeds": {n: scenarios.scenario_seed(args.seed, n) for n in args.scenario_names},
        },
        "ranks_per_gpu": placement.ranks_per_gpu,
        "shared_gpu": placement.shared,
        "process_group": placement.group_backend,
        "topology": layout,
    }
    _supervise.progress.update(backend=sel.name, meta=meta)
    steps: list[Step] = []
    try:
        steps = run_steps(rt, sel, backend, shape, args)
    finally:
        try:
            backend.destroy()
        except Exception as exc:  # a failing destroy must not hide the verdict
            print(f"{PROG}: rank {env.rank}: backend destroy failed: {exc}", file=sys.stderr)
    code = agree_code(rt, exit_code_of(steps, args.require))
    try:
        return output.finish(args, env, sel, steps, meta, code)
    finally:
        import torch.distributed as dist

        dist.barrier(group=rt.ctrl_group)
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return run(parse_args(argv), argv)
    except UsageError as exc:
        if os.environ.get("RANK", "0") == "0":
            print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
