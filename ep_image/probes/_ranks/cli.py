"""The command-line parts every probe on the rank machinery shares: the backend, shape, device
and run flags, their check into :class:`RunOptions`' fields, and the command around them.

Why this module exists: check_ep and check_train take the same flags for the same things (which
backend, the layer's shape, how the ranks run) and must refuse them alike, before any work (bad
usage is one line and exit 2, through ``ep_image.cli``); each probe's own ``cli`` adds its
flags to these.
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
from ep_image.probes._ranks import layer
from ep_image.probes._ranks.runtime import RankEnv
from ep_image.probes._report import EXIT_USAGE

BACKEND_CHOICES = ("auto", *BACKEND_NAMES, REFERENCE_BACKEND)


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
