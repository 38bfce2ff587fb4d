"""check_train's command line: flags in, one typed :class:`TrainOptions` out, then this
process's part: the local ranks, one rank, or (``--all-backends``) one run per backend venv.

Why this module exists: argparse's output is read and checked here once, before any work (bad
usage is one line and exit 2); the rank machinery (``_ranks``: its shared flags, then
``supervisor.run``) runs it, with check_train's kind.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

from ep_image import cli
from ep_image.probes._ranks import cli as rank_cli
from ep_image.probes._ranks import supervisor
from ep_image.probes.check_train.kind import CHECK_TRAIN
from ep_image.probes.check_train.steps import STEP_NAMES
from ep_image.probes.check_train.types import (
    CPU_DEFAULTS,
    GPU_DEFAULTS,
    LR_TIMES_HIDDEN,
    MAX_LR,
    PROG,
    TrainOptions,
)


def _defaults(key: str) -> str:
    return f"GPU {GPU_DEFAULTS[key]}, CPU {CPU_DEFAULTS[key]}"


def build_parser() -> cli.Parser:
    parser = cli.Parser(
        prog="check-train",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Prove that an expert-parallel backend trains: a small MoE transformer (top-k "
            "router, experts as grouped GEMMs between dispatch and combine, TE's fused "
            "attention and linears where TE and a GPU are there) trained for a few steps "
            "with AdamW, bf16 compute and fp32 weights, activation checkpointing around each "
            "layer, against the same model trained with the all-gather fallback: every step's "
            "loss and gradient held against the fallback's and against the backend's own step "
            "without checkpointing, every recomputed dispatch against its forward, memory "
            "that must not grow, and the step time beside the fallback's."
        ),
        epilog="""\
how to run:
  check-train                                   one rank, the backend installed here
  check-train --nproc-per-node 2 --backend torch   2 local ranks (CPU: gloo)
  check-train --nproc-per-node 4 --ranks-per-gpu 4 --backend NAME
                                                4 ranks sharing 1 GPU (functional)
  check-train --all-backends                    every backend venv under the prefix, one table
  torchrun --nproc-per-node 8 -m ep_image.probes.check_train --json train.json

exit codes (all ranks agree):
  0 all passed   1 a check failed (wrong losses or gradients, a recompute that got other
  rows, NaN, memory that grows every step), or the model did not train with these settings
  (the fallback neither: the backend is then not judged)   2 bad usage   3 backend unusable
  (it raised or crashed)   4 backend (or TE with --te on) missing   5 cannot run here (skipped)
""",
    )
    rank_cli.add_backend_flags(parser)
    parser.add_argument(
        "--all-backends",
        action="store_true",
        help="train the same model with every backend venv under --prefix in turn (each in its "
        f"own venv's python, stopped after {len(STEP_NAMES) + 1} x --timeout: one per step and "
        "one to start) and print one table",
    )
    parser.add_argument(
        "--prefix",
        metavar="DIR",
        help="where --all-backends finds the venvs (default: $EP_PREFIX, else /opt/venvs)",
    )
    shape = rank_cli.add_shape_flags(
        parser,
        "model shape (defaults: GPU 4096/1024/32/4, CPU 256/64/8/2; tokens per rank and step)",
    )
    shape.add_argument("--layers", type=int, help=f"MoE layers ({_defaults('layers')})")
    shape.add_argument("--steps", type=int, help=f"training steps ({_defaults('steps')})")
    shape.add_argument("--seq", type=int, help=f"sequence length ({_defaults('seq')})")
    shape.add_argument("--heads", type=int, help=f"attention heads ({_defaults('heads')})")
    parser.add_argument(
        "--lr",
        type=float,
        help=f"AdamW's learning rate, above 0 and at most {MAX_LR:g} (default: {LR_TIMES_HIDDEN} "
        "/ hidden: 1e-2 at hidden 64, 6.25e-4 at 1024; a wider model needs a smaller one)",
    )
    parser.add_argument(
        "--no-checkpoint",
        dest="checkpoint",
        action="store_false",
        help="train without activation checkpointing (default: non-reentrant checkpointing "
        "around each layer, its dispatch called again in the recompute)",
    )
    parser.add_argument(
        "--recompute",
        choices=("dispatch", "cached"),
        default="dispatch",
        help="what a recomputed layer asks of the backend: dispatch (again, as most frameworks "
        "do) or cached (a cached dispatch along the forward's layout, with its handle) "
        "(default: dispatch)",
    )
    parser.add_argument(
        "--te",
        choices=("auto", "on", "off"),
        default="auto",
        help="Transformer Engine's layers: auto (where TE is installed and a GPU is there), "
        "on (TE or nothing: missing is exit 4), off (default: auto)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "bfloat16", "float32"),
        help="compute dtype (weights stay fp32); auto: bfloat16 (default: auto)",
    )
    rank_cli.add_device_flag(parser)
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the weights and batches (default: 0)"
    )
    rank_cli.add_run_flags(parser)
    _own_help(
        parser,
        "--ranks-per-gpu",
        "let up to K local ranks share one GPU (round-robin) for a functional check on fewer "
        "GPUs: the group is gloo (NCCL refuses two ranks on one GPU, so backends that build "
        "NCCL communicators are refused), and step times are labelled 'shared GPU: not a link "
        "figure' (default: 1)",
    )
    return parser


def _own_help(parser: argparse.ArgumentParser, flag: str, text: str) -> None:
    """Replace the help of a flag the shared helpers added: theirs may name check_ep's own
    flags (``--min-gbs``), which this command does not take."""
    for action in parser._actions:
        if flag in action.option_strings:
            action.help = text
            return
    raise ValueError(f"{flag} is not a flag of {parser.prog}")


def parse_options(argv: Sequence[str] | None) -> TrainOptions:
    """The command line as checked :class:`TrainOptions`; bad usage raises ``cli.UsageError``."""
    args = build_parser().parse_args(argv)
    world = rank_cli.launch_world(args)
    for name in ("layers", "steps", "seq", "heads"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise cli.UsageError(f"--{name} must be a positive integer, got {value}")
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        raise cli.UsageError(f"--lr must be a positive finite number, got {args.lr:g}")
    if args.lr is not None and args.lr > MAX_LR:
        raise cli.UsageError(
            f"--lr {args.lr:g} is above {MAX_LR:g}: Adam moves every weight by about the rate "
            "each step, more than any weight of the model starts at, so it cannot train (the "
            f"default is {LR_TIMES_HIDDEN} / hidden)"
        )
    if args.all_backends and (args.backend != "auto" or args.backend_class):
        raise cli.UsageError("--all-backends runs every backend; drop --backend/--backend-class")
    if args.prefix and not args.all_backends:
        raise cli.UsageError("--prefix is where --all-backends looks; pass --all-backends too")
    return TrainOptions(
        **rank_cli.run_options_of(args, world),
        layers=args.layers,
        steps=args.steps,
        seq=args.seq,
        heads=args.heads,
        lr=args.lr,
        checkpoint=args.checkpoint,
        recompute=args.recompute,
        te=args.te,
        all_backends=args.all_backends,
        prefix=args.prefix,
    )


def run(options: TrainOptions, argv: list[str]) -> int:
    if options.all_backends:
        from ep_image.probes.check_train.all_backends import run as run_all

        return run_all(options, argv)
    return supervisor.run(CHECK_TRAIN, options, argv)


def main(argv: list[str] | None = None) -> int:
    """The ``check-train`` command."""
    return rank_cli.run_main(PROG, parse_options, run, argv)
