"""check_ep's command line: flags in, one typed :class:`Options` out, then this process's part.

Why this module exists: argparse's output is read here, once: checked before any work (bad
usage is one line and exit 2, through ``ep_image.cli``) and turned into the frozen options the
rest of check_ep takes. Then this process either starts the local ranks (``--nproc-per-node``)
or is one rank, watched by its supervisor. See docs/probes.md, section "check-ep".
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ep_image import cli
from ep_image.probes._backend_detect import BACKEND_NAMES, REFERENCE_BACKEND
from ep_image.probes._report import EXIT_USAGE
from ep_image.probes.check_ep import layer, supervisor
from ep_image.probes.check_ep.kind import CHECK_EP
from ep_image.probes.check_ep.ranks import RankEnv
from ep_image.probes.check_ep.scenarios import catalogue
from ep_image.probes.check_ep.types import PROG, Options

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

scenarios (--scenarios): changing, skewed, dropped, uneven, reuse, views, interleaved,
  recompute, lifecycle, marks; see docs/probes.md

exit codes (all ranks agree):
  0 all passed   1 a check failed (wrong numbers)   2 bad usage
  3 backend unusable (imports, fails at run time)   4 backend missing
  5 this environment cannot run it (skipped; --require turns it into 1)

under torchrun, torchrun itself exits 1 for any non-zero code; the probe's own code is in
the table's last line and in the JSON report's exit_code.
""",
    )
    add_backend_flags(parser)
    add_shape_flags(parser, "layer shape (defaults: GPU 4096/7168/256/8, CPU 256/512/32/4)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "bfloat16", "float32", "float16"),
        help="token dtype; auto: bfloat16 on GPU, float32 on CPU. DeepEP backends take "
        "bfloat16 only (default: auto)",
    )
    add_device_flag(parser)
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
    add_run_flags(parser)
    return parser


def add_backend_flags(parser: cli.Parser) -> None:
    """--backend and --backend-class: which backend runs (every probe on a backend)."""
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


def add_shape_flags(parser: cli.Parser, title: str) -> argparse._ArgumentGroup:
    """The MoE layer's sizes (--tokens, --hidden, --experts, --topk), in a group ``title``."""
    shape = parser.add_argument_group(title)
    shape.add_argument("--tokens", type=int, help="tokens per rank")
    shape.add_argument("--hidden", type=int, help="hidden size of a token")
    shape.add_argument("--experts", type=int, help="experts over all ranks (divisible by ranks)")
    shape.add_argument("--topk", type=int, help="experts per token (<= experts)")
    return shape


def add_device_flag(parser: cli.Parser) -> None:
    parser.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cuda", "cpu"),
        help="where the torch backend runs; auto: cuda when a GPU is visible. DeepEP backends "
        "always need cuda (default: auto)",
    )


def add_run_flags(parser: cli.Parser) -> None:
    """--timeout, --json, --require, --nproc-per-node, --ranks-per-gpu: how the ranks run."""
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


def parse_options(argv: Sequence[str] | None) -> Options:
    """The command line as checked :class:`Options`; bad usage raises ``cli.UsageError``."""
    args = build_parser().parse_args(argv)
    return options_of(args, launch_world(args))


def options_of(args: argparse.Namespace, world: int) -> Options:
    """argparse's output, checked for ``world`` ranks, as :class:`Options`: positive sizes,
    top-k vs experts, divisibility; nothing here needs torch."""
    for name in ("replays", "iters"):
        if getattr(args, name) < 1:
            raise cli.UsageError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise cli.UsageError(f"--warmup must be >= 0, got {args.warmup}")
    if args.tolerance is not None and args.tolerance <= 0:
        raise cli.UsageError(f"--tolerance must be positive, got {args.tolerance}")
    try:
        scenarios = tuple(catalogue.parse(args.scenarios))
    except ValueError as exc:
        raise cli.UsageError(f"--scenarios: {exc}") from None
    return Options(
        **run_options_of(args, world),
        scenarios=scenarios,
        replays=args.replays,
        warmup=args.warmup,
        iters=args.iters,
        tolerance=args.tolerance,
        min_gbs=args.min_gbs,
    )


def run_options_of(args: argparse.Namespace, world: int) -> dict[str, Any]:
    """The flags of :class:`RunOptions` from argparse's output, checked for ``world`` ranks
    (the layer's shape by ``layer.validate_shape``), as keyword arguments."""
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
    if args.timeout <= 0:
        raise cli.UsageError(f"--timeout must be positive, got {args.timeout}")
    if args.nproc_per_node is not None and args.nproc_per_node < 1:  # None: not given
        raise cli.UsageError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    if args.ranks_per_gpu < 1:
        raise cli.UsageError(f"--ranks-per-gpu must be >= 1, got {args.ranks_per_gpu}")
    layer.validate_shape(args.tokens, args.hidden, args.experts, args.topk, world)
    return {
        "backend": args.backend,
        "backend_class": args.backend_class,
        "tokens": args.tokens,
        "hidden": args.hidden,
        "experts": args.experts,
        "topk": args.topk,
        "dtype": args.dtype,
        "device": args.device,
        "seed": args.seed,
        "timeout": args.timeout,
        "json": args.json,
        "require": args.require,
        "nproc_per_node": args.nproc_per_node or 0,
        "ranks_per_gpu": args.ranks_per_gpu,
    }


def launch_world(args: argparse.Namespace) -> int:
    """The world size the flags are checked for: --nproc-per-node's, else torchrun's."""
    env = RankEnv.from_environ()
    if args.nproc_per_node and env.launched:
        raise cli.UsageError("--nproc-per-node cannot be used under torchrun; pass one of them")
    return args.nproc_per_node if args.nproc_per_node else env.world


def run(options: Options, argv: list[str]) -> int:
    """Start the local ranks or be one rank (``supervisor.run``)."""
    return supervisor.run(CHECK_EP, options, argv)


def main(argv: list[str] | None = None) -> int:
    """The ``check-ep`` command."""
    return run_main(PROG, parse_options, run, argv)


def run_main(
    prog: str,
    parse: Callable[[Sequence[str] | None], Any],
    body: Callable[[Any, list[str]], int],
    argv: list[str] | None,
) -> int:
    """A rank probe's command: parse, then ``body(options, argv)``. Under torchrun, rank 0
    alone prints a usage error; every rank exits 2 with it."""
    args = list(sys.argv[1:] if argv is None else argv)
    if os.environ.get("RANK", "0") != "0":
        try:
            options = parse(args)
        except cli.UsageError:
            return EXIT_USAGE
        return cli.run(prog, lambda _: options, lambda o: body(o, args), args)
    return cli.run(prog, parse, lambda o: body(o, args), args)
