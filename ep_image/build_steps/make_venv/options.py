"""make_venv's command line and the typed options it becomes (``Options``).

Why apart: the build modes take a typed ``Options``, never the argparse namespace, and the
command line (most of it help text) is a job of its own.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ep_image import backends as ep_backends
from ep_image import cli
from ep_image.build_steps._te_wheels import TE_RECORD, select_te_wheels
from ep_image.build_steps._venv.layout import SKELETON_RECORD, VENV_RECORD
from ep_image.build_steps.make_venv.backend_sync import Wheels
from ep_image.build_steps.make_venv.bytecode import wants_bytecode
from ep_image.build_steps.make_venv.venv_record import SKELETONS_RECORD

PROG = "make_venv"


class Mode(enum.Enum):
    """What one run builds."""

    VENV = "venv"  # finished venvs, each under a temporary name renamed into place (host mode)
    SKELETON = "skeleton"  # the image's shared layer: every venv without its backend
    COMPLETE = "complete"  # the image's ep-<backend> stage: a skeleton completed in place


@dataclass
class Options:
    """What to build, as parsed from the command line."""

    backends: list[str]
    prefix: Path
    project: Path
    te_wheels: list[Path] = field(default_factory=list)
    python: str | None = None
    no_install_packages: list[str] = field(default_factory=list)
    keep_going: bool = False
    compile_bytecode: bool = False
    variant: str | None = None
    dedup: bool = False
    mode: Mode = Mode.VENV
    wheels: Wheels = field(default_factory=Wheels)


def build_parser() -> cli.Parser:
    """The command line (documentation included); ``parse_args`` checks what it cannot."""
    parser = cli.Parser(
        prog=PROG,
        description=(
            "Create <prefix>/<backend>, a venv holding one EP backend, from the committed "
            "uv.lock (uv sync --frozen --extra <backend>), plus Transformer Engine from a wheel "
            "built once by build_te. The venv is built under a temporary name and "
            f"renamed into place when complete, with <venv>/{VENV_RECORD} saying what it holds."
        ),
        epilog=(
            f"Backends: {ep_backends.valid_names_text()}. Exit codes: 0 built; 1 the build "
            "failed (nothing left behind); 2 bad usage (e.g. an unknown backend); 130 "
            "interrupted. Example: "
            f"python3 scripts/make_venv.py --backend {ep_backends.DEFAULT_BACKEND} "
            "--prefix /opt/venvs "
            "--te-wheel /wheels/transformer_engine-2.17.0-cp312-cp312-linux_x86_64.whl"
        ),
    )
    parser.add_argument(
        "--backend",
        required=True,
        action="append",
        metavar="NAME",
        help=(
            "the backend to build: "
            f"{ep_backends.valid_names_text()}; host mode also takes 'all', a comma list "
            "or the flag repeated, and builds each in turn"
        ),
    )
    parser.add_argument(
        "--prefix", required=True, type=Path, help="directory that holds the backend venvs"
    )
    parser.add_argument(
        "--project",
        type=Path,
        default=ep_backends.DEFAULT_PROJECT,
        help="directory with pyproject.toml and uv.lock (default: this repository)",
    )
    parser.add_argument(
        "--te-wheel",
        action="append",
        default=[],
        type=Path,
        metavar="PATH",
        help="Transformer Engine wheel from build_te, installed with --no-deps (repeatable)",
    )
    parser.add_argument(
        "--te-wheel-dir",
        type=Path,
        metavar="DIR",
        help=(
            "install every transformer_engine-*.whl in DIR (the image's te stage output); "
            "a DIR without one means no TE, which is said, not an error"
        ),
    )
    parser.add_argument(
        "--te-record",
        type=Path,
        metavar="FILE",
        help=(
            f"with --te-wheel-dir: install exactly the wheel this {TE_RECORD} names (none if "
            "it says TE was skipped), and fail unless DIR holds the same record and that "
            "wheel with its sha256 (the image's ep stages, which mount DIR)"
        ),
    )
    parser.add_argument("--python", help="interpreter for the venv (passed to uv venv --python)")
    parser.add_argument(
        "--no-install-package",
        action="append",
        default=[],
        metavar="PKG",
        help=(
            "also skip this package (repeatable). For footprint estimates only, e.g. a backend "
            f"without its git-built deep-ep; {VENV_RECORD} then says backend_installed=false"
        ),
    )
    parser.add_argument(
        "--no-install-packages",
        default="",
        metavar="LIST",
        help="the same for a space- or comma-separated LIST (the image's VENV_SKIP_PACKAGES)",
    )
    parser.add_argument(
        "--compile-bytecode",
        action="store_true",
        help=(
            "compile site-packages to hash-checked .pyc files that are identical across venvs "
            "(so dedup.py can share them); also on when UV_COMPILE_BYTECODE is set, which is "
            "then not passed to uv"
        ),
    )
    parser.add_argument(
        "--variant",
        metavar="EXTRA",
        help=(
            "install the one --backend from this variant's extra instead (same venv name, same "
            "probes): "
            + ", ".join(
                f"{v.extra} ({s.name}: {v.summary})" for s in ep_backends.SPECS for v in s.variants
            )
        ),
    )
    parser.add_argument(
        "--dedup",
        action="store_true",
        help=(
            "hardlink identical files inside the new venv before it is moved into place "
            "(dedup.py; the image's ep stages, whose layer a one-backend image reuses)"
        ),
    )
    steps = parser.add_mutually_exclusive_group()
    steps.add_argument(
        "--skeleton",
        action="store_true",
        help=(
            "the image's shared layer: each backend's venv without its own distribution "
            f"({SKELETON_RECORD}), deduplicated across them with --dedup; backends the project "
            f"lacks are skipped, and <prefix>/{SKELETONS_RECORD} says which"
        ),
    )
    steps.add_argument(
        "--complete",
        action="store_true",
        help=(
            "the image's ep-<backend> stage: install the backend's distribution into its "
            "skeleton in place (same lock and skip list, else exit 1); --te-* are not needed"
        ),
    )
    parser.add_argument(
        "--prebuilt-wheels",
        type=Path,
        metavar="DIR",
        help=(
            "take a source-built backend's wheel from DIR instead of compiling it, when the "
            "record beside it (<backend>-wheel.json) matches this build: pinned commit, locked "
            "torch/NVSHMEM/NCCL, arch list, CUDA home, nvcc, declared build variables, Python; "
            "else compile, saying which field differs (the image's PREBUILT_WHEELS)"
        ),
    )
    parser.add_argument(
        "--export-wheels",
        type=Path,
        metavar="DIR",
        help=(
            "after compiling a source-built backend, copy the wheel uv built into DIR with its "
            "record, for --prebuilt-wheels later (a CI cache, another machine)"
        ),
    )
    parser.add_argument(
        "--keep-going",
        action="store_true",
        help="with several backends, build the others when one fails (exit 1 at the end)",
    )
    return parser


def parse_args(argv: Sequence[str] | None) -> Options:
    """The options; a UsageError for bad usage (exit 2), a FixableError for a TE record that
    does not match its wheel (exit 1)."""
    args = build_parser().parse_args(argv)
    try:
        backends = ep_backends.expand_backends(args.backend)
    except ep_backends.UnknownBackendError as exc:
        raise cli.UsageError(str(exc)) from None
    if args.variant is not None:
        if len(backends) != 1:
            raise cli.UsageError("--variant takes exactly one --backend")
        try:
            ep_backends.get_backend(backends[0], args.project.resolve(), args.variant)
        except (ep_backends.UnknownBackendError, ep_backends.RegistryError) as exc:
            raise cli.UsageError(str(exc)) from None
    if args.te_record is not None and args.te_wheel_dir is None:
        raise cli.UsageError("--te-record needs --te-wheel-dir")
    te_wheels = select_te_wheels(args.te_wheel, args.te_wheel_dir, args.te_record)
    skip = [*args.no_install_package, *args.no_install_packages.replace(",", " ").split()]
    mode = Mode.SKELETON if args.skeleton else Mode.COMPLETE if args.complete else Mode.VENV
    return Options(
        backends=backends,
        prefix=args.prefix.resolve(),
        project=args.project.resolve(),
        te_wheels=te_wheels,
        python=args.python,
        no_install_packages=skip,
        keep_going=args.keep_going,
        compile_bytecode=wants_bytecode(args.compile_bytecode),
        variant=args.variant,
        dedup=args.dedup,
        mode=mode,
        wheels=Wheels(
            args.prebuilt_wheels.resolve() if args.prebuilt_wheels else None,
            args.export_wheels.resolve() if args.export_wheels else None,
        ),
    )
