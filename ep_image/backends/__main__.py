"""``python -m ep_image.backends`` (the ``ep-backends`` command): the registry on the command line.

Why a module of its own: the registry (``__init__.py``) is a library every part imports; its
command line prints it for people and for what cannot import Python (the workflows' matrices).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from ep_image import cli
from ep_image.backends import (
    BACKEND_NAMES,
    DEFAULT_BACKEND,
    DEFAULT_PROJECT,
    RegistryError,
    image_ep_values,
    load_registry,
    valid_names_text,
    workflow_matrix,
)

PROG = "ep_image.backends"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.Parser(
        prog="python -m ep_image.backends",
        description=(
            "Print the EP backend registry (ep_image/backends/, one module per backend): each "
            "backend's uv extra, the "
            "distribution that ships its module (`deep_ep`, or its own), the marker file that "
            "identifies its layout, what its build needs, and its requirement and source as "
            "pyproject.toml pins them."
        ),
        epilog=f"Backends: {valid_names_text()}; default: {DEFAULT_BACKEND}. Exit codes: 0 "
        "printed; 1 pyproject.toml and the registry disagree; 2 bad usage.",
    )
    parser.add_argument(
        "--project",
        type=Path,
        default=DEFAULT_PROJECT,
        help="directory holding pyproject.toml (default: this repository)",
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--json", action="store_true", help="print the registry as JSON")
    group.add_argument(
        "--names", action="store_true", help="print only the backend names, one a line"
    )
    group.add_argument(
        "--image-ep",
        action="store_true",
        help="print every EP value the image accepts and the backends it selects",
    )
    group.add_argument("--default", action="store_true", help="print the default backend")
    group.add_argument(
        "--matrix",
        action="store_true",
        help="print the CI workflows' matrices as JSON: backends, image EP values, and the "
        "backends whose ranks may share a GPU",
    )
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    if args.names:
        print("\n".join(BACKEND_NAMES))
        return 0
    if args.default:
        print(DEFAULT_BACKEND)
        return 0
    if args.matrix:
        print(json.dumps(workflow_matrix()))
        return 0
    if args.image_ep:
        for value, selected in image_ep_values():
            print(f"{value}\t{' '.join(selected)}")
        return 0
    try:
        registry = load_registry(args.project)
    except RegistryError as exc:
        raise cli.FixableError(
            str(exc), "make pyproject.toml's extras and sources match ep_image/backends/"
        ) from None
    if args.json:
        print(json.dumps({n: asdict(b) for n, b in registry.items()}, indent=2))
        return 0
    for backend in registry.values():
        default = " (default)" if backend.name == DEFAULT_BACKEND else ""
        print(
            f"{backend.name:10} extra={backend.extra} dist={backend.distribution} "
            f"req={backend.requirement!r} source={backend.source_label} "
            f"marker={backend.marker_file}{default}"
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return cli.run(PROG, parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
