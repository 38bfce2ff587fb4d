"""check_ep's command line: flags in, one typed :class:`Options` out, then this process's part.

Why this module exists: argparse's output is read here, once: checked before any work (bad
usage is one line and exit 2, through ``ep_image.cli``) and turned into the frozen options the
rest of check_ep takes (the flags every rank probe takes are ``_ranks/cli.py``'s). Then this
process either starts the local ranks (``--nproc-per-node``) or is one rank, watched by its
supervisor. See docs/probes.md, section "check-ep".
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ep_image import cli
from ep_image.probes._ranks import supervisor
from ep_image.probes._ranks.cli import (
    add_backend_flags,
    add_device_flag,
    add_run_flags,
    add_shape_flags,
    launch_world,
    run_main,
    run_options_of,
)
from ep_image.probes.check_ep.kind import CHECK_EP
from ep_image.probes.check_ep.options import PROG, Options
from ep_image.probes.check_ep.scenarios import catalogue


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


def run(options: Options, argv: list[str]) -> int:
    """Start the local ranks or be one rank (``supervisor.run``)."""
    return supervisor.run(CHECK_EP, options, argv)


def main(argv: list[str] | None = None) -> int:
    """The ``check-ep`` command."""
    return run_main(PROG, parse_options, run, argv)
