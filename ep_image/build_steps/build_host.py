"""Host mode: every requested backend's venv under a prefix, deduplicated, one made active.

Why: clusters without Docker need the image's venvs from the same lock and the same steps.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from ep_image import backends as ep_backends
from ep_image import child_env, cli
from ep_image.build_steps import dedup
from ep_image.build_steps._uv import trust_store
from ep_image.build_steps._venv.layout import USE_EP

#: The name of what the user ran, for usage and messages: the entry point build-host,
#: scripts/build_host.sh (which says so in EP_IMAGE_DOOR), or the Python front door
#: scripts/build_host.py (``python -m`` runs this file under the same name).
ENTRY_POINT = "build-host"
PROG = (
    ENTRY_POINT
    if Path(sys.argv[0]).name == ENTRY_POINT
    else os.environ.get("EP_IMAGE_DOOR") or "build_host.py"
)
EXIT_FAILED = 1
#: The options that take a value, and what the value is (named when it is missing).
VALUES = {"--prefix": "DIR", "--backends": "LIST", "--te-wheel": "PATH", "--python": "PY",
          "--project": "DIR", "--activate": "BACKEND"}  # fmt: skip

USAGE = (
    f"{PROG} --prefix DIR [--backends LIST] [--te-wheel PATH]... [--python PY]\n"
    f"{' ' * len(f'usage: {PROG} ')}[--project DIR] [--no-read-only] [--activate BACKEND]"
)
DESCRIPTION = """\
Build EP backend venvs under DIR (one per backend, from the committed uv.lock), then hardlink
identical files across them, so all of them cost about as much disk as one."""
EPILOG = """\
Exit codes: 0 all built; 1 a backend failed (the others are built and deduplicated); 2 usage.
Needs: uv (on PATH, or installed by python3 scripts/bootstrap.py), Python >= 3.11
to run the scripts (PYTHON=..., else python3, else uv's). Every step is
ep_image/build_steps/make_venv/, the command the image's ep-<backend> stages run too: HybridEP's
NVSHMEM set-up included.
docs/host-mode.md is the guide."""


def build_parser() -> cli.Parser:
    parser = cli.Parser(
        prog=PROG,
        usage=USAGE,
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
        exit_on_error=False,
    )
    parser.add_argument(
        "--prefix",
        metavar=VALUES["--prefix"],
        default=os.environ.get("EP_PREFIX", ""),
        help="where the venvs go (default: $EP_PREFIX); use a filesystem that supports "
        "hardlinks, and the same one for all backends",
    )
    parser.add_argument(
        "--backends",
        metavar=VALUES["--backends"],
        default=os.environ.get("EP_BACKENDS") or "all",
        help=f"comma list of backends ({ep_backends.valid_names_text()}), or all "
        "(default: $EP_BACKENDS or all); a backend that fails does not stop the others",
    )
    parser.add_argument(
        "--te-wheel",
        metavar=VALUES["--te-wheel"],
        action="append",
        default=[],
        help="Transformer Engine wheel from ep_image.build_steps.build_te, put in every venv",
    )
    parser.add_argument(
        "--python",
        metavar=VALUES["--python"],
        help="interpreter for the venvs (uv venv --python; uv may download one)",
    )
    parser.add_argument(
        "--project",
        metavar=VALUES["--project"],
        help="the pyproject.toml + uv.lock to build from (default: this repository)",
    )
    parser.add_argument(
        "--read-only",
        dest="read_only",
        action="store_true",
        default=True,
        help="dedup --read-only (the default): an in-place write into one venv fails instead "
        "of changing all of them; see docs/host-mode.md",
    )
    parser.add_argument(
        "--no-read-only",
        dest="read_only",
        action="store_false",
        help="keep write bits on shared files",
    )
    parser.add_argument(
        "--activate", metavar=VALUES["--activate"], help="point DIR/active at BACKEND when done"
    )
    return parser


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The options, or a UsageError naming the first bad argument (exit 2; after an unknown
    one, the usage follows)."""
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as exc:
        option = exc.argument_name or "an option"
        raise cli.UsageError(f"{option} needs {VALUES.get(option, 'a value')}") from None
    if unknown:
        raise cli.UsageError(f"unknown argument {unknown[0]}\n{parser.format_usage().rstrip()}")
    if not args.prefix:
        raise cli.UsageError("--prefix DIR (or EP_PREFIX) is required")
    return args


def installed_backends(prefix: Path) -> tuple[int, list[str]]:
    """``use-ep --list`` for ``prefix``: its exit code and the backends it lists."""
    proc = subprocess.run(
        [str(USE_EP), "--list"],
        env={**os.environ, "EP_PREFIX": str(prefix)},
        stdout=subprocess.PIPE,
        text=True,
        check=False,
    )
    return proc.returncode, [line for line in proc.stdout.splitlines() if line]


def build(args: argparse.Namespace, prefix: Path) -> int:
    """make_venv for every backend (--keep-going), dedup across the venvs built, activate."""
    # Copies, not links into uv's cache: the prefix then stands alone (the cache may be on another
    # filesystem, be pruned, or belong to someone else), and dedup.py does the sharing, within it.
    env = child_env({**os.environ, "UV_LINK_MODE": os.environ.get("UV_LINK_MODE") or "copy"})
    make_venv = [sys.executable, "-m", "ep_image.build_steps.make_venv", "--backend", args.backends]
    make_venv += ["--prefix", str(prefix), "--keep-going"]
    make_venv += [f"--python={args.python}"] if args.python else []
    make_venv += [f"--project={args.project}"] if args.project else []
    make_venv += [f"--te-wheel={wheel}" for wheel in args.te_wheel]
    status = subprocess.run(make_venv, env=env, check=False).returncode

    listed, venvs = installed_backends(prefix)
    if listed != 0:
        return listed
    if len(venvs) >= 2:
        read_only = ["--read-only"] if args.read_only else []
        linking = dedup.command(*read_only, "--json", prefix / "dedup.json", *venvs)
        if subprocess.run(linking, env=env, cwd=prefix, check=False).returncode != 0:
            status = EXIT_FAILED
    if args.activate:
        activate = [str(USE_EP), "--activate", args.activate]
        ep_env = {**env, "EP_PREFIX": str(prefix)}
        done = subprocess.run(activate, env=ep_env, stdout=subprocess.DEVNULL, check=False)
        if done.returncode != 0:
            status = EXIT_FAILED

    print(f"{PROG}: backends under {prefix}: {' '.join(venvs)}")
    print(f'{PROG}: switch with: eval "$(EP_PREFIX={prefix} {USE_EP} BACKEND)"')
    return status


def run(args: argparse.Namespace) -> int:
    trust_store.use_system_trust_store()  # behind a TLS-inspecting proxy too; make_venv inherits it
    prefix = Path(os.path.abspath(args.prefix))
    try:
        prefix.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise cli.FixableError(
            f"cannot create --prefix {prefix}: {exc.strerror}",
            "give --prefix (or EP_PREFIX) a directory this user can create, on a filesystem "
            "with hardlinks",
        ) from None
    return build(args, prefix)


def main(argv: Sequence[str] | None = None) -> int:
    return cli.run(PROG, parse_args, run, argv, terminate_cleanly=True)


if __name__ == "__main__":
    sys.exit(main())
