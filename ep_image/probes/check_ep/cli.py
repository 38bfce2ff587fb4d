"""check_ep's command line: flags in, one typed :class:`Options` out, then this process's part.

Why this module exists: argparse's output is read here, once: checked before any work (bad
usage is one line and exit 2, through ``ep_image.cli``) and turned into the frozen options the
rest of check_ep takes. Then this process either starts the local ranks (``--nproc-per-node``)
or is one rank, watched by its supervisor. See docs/probes.md, section "check-ep".
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from ep_image import cli
from ep_image.probes._backend_detect import BACKEND_NAMES, REFERENCE_BACKEND
from ep_image.probes._report import EXIT_USAGE
from ep_image.probes.check_ep import launch, layer, preflight, supervisor
from ep_image.probes.check_ep.ranks import RankEnv
from ep_image.probes.check_ep.scenarios import catalogue
from ep_image.probes.check_ep.types import PROG, Options

#: What the ranks of ``--nproc-per-node`` run: ``python -m MODULE``, the package's __main__.
MODULE = "ep_image.probes.check_ep"
BACKEND_CHOICES = ("auto", *BACKEND_NAMES, REFERENCE_BACKEND)


def build_parser() -> cli.Parser:
    parser = cli.Parser(
        prog="check-ep",
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
  torchrun --nproc-per-node 8 -m ep_image.probes.check_ep --json out.json
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
        help=f"backend to check: auto, {', '.join(BACKEND_NAMES)} or torch (the "
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
        f"{', '.join(catalogue.NAMES)} (default: all)",
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
    parser.add_json()
    parser.add_require(
        "treat 'cannot run here' (exit 5) as a failure (exit 1): for CI on GPU runners"
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
    return parser


def parse_options(argv: Sequence[str] | None) -> Options:
    """The command line as checked :class:`Options`; bad usage raises ``cli.UsageError``."""
    args = build_parser().parse_args(argv)
    env = RankEnv.from_environ()
    if args.nproc_per_node and env.launched:
        raise cli.UsageError("--nproc-per-node cannot be used under torchrun; pass one of them")
    world = args.nproc_per_node if args.nproc_per_node else env.world
    return options_of(args, world)


def options_of(args: argparse.Namespace, world: int) -> Options:
    """argparse's output, checked for ``world`` ranks, as :class:`Options`: positive sizes,
    top-k vs experts, divisibility; nothing here needs torch."""
    if args.backend not in BACKEND_CHOICES:
        raise cli.UsageError(
            f"unknown backend {args.backend!r}; choose one of {', '.join(BACKEND_CHOICES)}"
        )
    if args.backend_class and args.backend != "auto":
        raise cli.UsageError("--backend-class replaces --backend; pass only one of them")
    if args.backend_class:
        target = args.backend_class.rpartition(":")[0]
        if (target.endswith(".py") or "/" in target) and not Path(target).is_file():
            raise cli.UsageError(f"--backend-class: file not found: {target}")
    for name in ("tokens", "hidden", "experts", "topk"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise cli.UsageError(f"--{name} must be a positive integer, got {value}")
    for name in ("replays", "iters"):
        if getattr(args, name) < 1:
            raise cli.UsageError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise cli.UsageError(f"--warmup must be >= 0, got {args.warmup}")
    if args.timeout <= 0:
        raise cli.UsageError(f"--timeout must be positive, got {args.timeout}")
    if args.tolerance is not None and args.tolerance <= 0:
        raise cli.UsageError(f"--tolerance must be positive, got {args.tolerance}")
    if args.nproc_per_node < 0:
        raise cli.UsageError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    if args.ranks_per_gpu < 1:
        raise cli.UsageError(f"--ranks-per-gpu must be >= 1, got {args.ranks_per_gpu}")
    try:
        scenarios = tuple(catalogue.parse(args.scenarios))
    except ValueError as exc:
        raise cli.UsageError(f"--scenarios: {exc}") from None
    layer.validate_shape(args.tokens, args.hidden, args.experts, args.topk, world)
    return Options(
        backend=args.backend,
        backend_class=args.backend_class,
        tokens=args.tokens,
        hidden=args.hidden,
        experts=args.experts,
        topk=args.topk,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        scenarios=scenarios,
        replays=args.replays,
        warmup=args.warmup,
        iters=args.iters,
        tolerance=args.tolerance,
        min_gbs=args.min_gbs,
        timeout=args.timeout,
        json=args.json,
        require=args.require,
        nproc_per_node=args.nproc_per_node,
        ranks_per_gpu=args.ranks_per_gpu,
    )


def run(options: Options, argv: list[str]) -> int:
    """Start the local ranks (``--nproc-per-node``: ``argv`` again, without that flag), or be
    one rank: its supervisor's exit code, which rank 0 also leaves for a local launcher.
    What can be refused before any rank starts is refused first (``preflight``)."""
    env = RankEnv.from_environ()
    missing = preflight.torch_missing()
    if missing is not None:
        if options.nproc_per_node:  # the ranks it would have started, on this one node
            n = options.nproc_per_node
            env = dataclasses.replace(env, world=n, local_world=n)
        return supervisor.report_verdict(options, env, missing)
    if options.nproc_per_node:
        preflight.check_local_launch(options, preflight.visible_gpus())
        return launch.launch_local(options.nproc_per_node, MODULE, argv)
    code = supervisor.supervise(options, env)
    if env.rank == 0:
        launch.write_exit_code(code)
    return code


def main(argv: list[str] | None = None) -> int:
    """The ``check-ep`` command. Under torchrun, rank 0 alone prints a usage error; every rank
    exits 2 with it."""
    args = list(sys.argv[1:] if argv is None else argv)
    if os.environ.get("RANK", "0") != "0":
        try:
            options = parse_options(args)
        except cli.UsageError:
            return EXIT_USAGE
        return cli.run(PROG, lambda _: options, lambda o: run(o, args), args)
    return cli.run(PROG, parse_options, lambda o: run(o, args), args)
