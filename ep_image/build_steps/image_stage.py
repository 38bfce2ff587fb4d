#!/usr/bin/env python3
"""The image's own steps, after make_venv built each backend's venv in its ``ep-<backend>`` stage.

``assemble`` (stage ``image-<EP>``, one RUN, one layer): the selected venvs onto their skeletons
(tree_sync writes only what each stage added), the other skeletons removed, dedup, the active
backend, the venv's cuDNN first, ``image.json``. ``manifest`` (stage ``final``): check-env's
``env-manifest.json``. The stages and why: docs/image.md, "Stages".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from ep_image import SOURCE_ROOT, backends, child_env, cli
from ep_image.build_steps import dedup, stage_cudnn, tree_sync
from ep_image.build_steps._venv.layout import SKELETON_RECORD as SKELETON_FILE
from ep_image.build_steps._venv.layout import USE_EP
from ep_image.build_steps._venv.layout import VENV_RECORD as INFO_FILE
from ep_image.files.records import not_a_file, write_json

PROG = "image_stage"


class StageError(RuntimeError):
    """The stage cannot do its job; the message says why and what fixes it."""


def assemble(names: list[str], mounts: Path, prefix: Path, in_place: bool = False) -> list[Path]:
    """Make ``<prefix>/<name>`` equal to ``<mounts>/ep-<name>/<name>`` for each, drop the
    other venvs and skeletons, then deduplicate; ``in_place``: the one venv is already there."""
    prefix.mkdir(parents=True, exist_ok=True)
    names = backends.expand_backends(names)
    if in_place:
        if len(names) != 1:
            raise StageError(
                f"--in-place takes one backend (its stage is the image's start), got {names}"
            )
        if not (prefix / names[0] / INFO_FILE).is_file():
            raise StageError(
                f"{prefix / names[0]} holds no venv (no {INFO_FILE}): --in-place needs the "
                f"stage to start FROM ep-{names[0]}"
            )
    else:
        for name in names:
            source = mounts / f"ep-{name}" / name
            if not (source / INFO_FILE).is_file():
                raise StageError(
                    f"{source} holds no venv (no {INFO_FILE}): stage ep-{name} did not build "
                    "one, or the builder did not mount it"
                )
            started = time.monotonic()
            target = prefix / name
            held = "its skeleton" if (target / SKELETON_FILE).is_file() else "no skeleton"
            try:
                report = tree_sync.sync_tree(source, target)
            except (tree_sync.SyncError, OSError) as exc:
                raise StageError(f"{name}: taking the venv from ep-{name} failed: {exc}") from None
            print(
                f"image_stage: {name} from ep-{name} onto {held} in "
                f"{time.monotonic() - started:.1f}s: {report.summary()}",
                flush=True,
            )
    for other in sorted(prefix.iterdir()):
        unselected = other.name not in names and other.is_dir() and not other.is_symlink()
        if unselected and any((other / f).is_file() for f in (INFO_FILE, SKELETON_FILE)):
            shutil.rmtree(other)
            print(f"image_stage: removed {other} (EP does not select it)", flush=True)
    venvs = [prefix / name for name in names]
    cmd = dedup.command("--json", prefix / "dedup.json", *venvs)
    subprocess.run(cmd, env=child_env(), check=True)
    te_record = SOURCE_ROOT / "te" / "te-build.json"  # the te stage's, via assemble-files
    if te_record.is_file():
        write_json(prefix / "te-build.json", json.loads(te_record.read_text()))
    return venvs


def installed(prefix: Path) -> list[str]:
    """Backends with a finished venv under ``prefix``, in registry order."""
    return [n for n in backends.BACKEND_NAMES if (prefix / n / INFO_FILE).is_file()]


def activate(prefix: Path, active: str) -> None:
    """``use-ep --activate`` (the switch host mode uses too), with use-ep on PATH."""
    link = Path("/usr/local/bin/use-ep")
    if not link.exists():
        link.symlink_to(USE_EP)
    env = {**os.environ, "EP_PREFIX": str(prefix)}
    subprocess.run(
        [str(USE_EP), "--activate", active], env=env, check=True, stdout=subprocess.DEVNULL
    )


def image_record(prefix: Path, ep: str, names: list[str], active: str) -> dict[str, object]:
    """/opt/venvs/image.json: what the image holds and how to switch."""
    venvs = {n: json.loads((prefix / n / INFO_FILE).read_text()) for n in names}
    return {
        "ep": ep,
        "backends": names,
        "active": active,
        "default_backend": backends.DEFAULT_BACKEND,
        "switch": 'eval "$(use-ep --activate BACKEND)", or run with -e EP_BACKEND=BACKEND',
        "skipped_packages": {n: v.get("skipped_packages", []) for n, v in venvs.items()},
        "lock_sha256": sorted({v.get("lock_sha256") for v in venvs.values()}),
    }


def manifest(prefix: Path) -> None:
    """check_env in the active venv; a failure is a warning, not a failed build."""
    python = prefix / "active" / "bin" / "python"
    cmd = [
        str(python),
        "-m",
        "ep_image.probes.check_env",
        "--json",
        str(prefix / "env-manifest.json"),
    ]
    started = time.monotonic()
    code = subprocess.run(cmd, env=child_env(), check=False, stdout=subprocess.DEVNULL).returncode
    print(f"image_stage: check_env.py exit {code} in {time.monotonic() - started:.0f}s")
    if code != 0:
        print("image_stage: warning: check_env.py failed; env-manifest.json may be partial")


def finish(prefix: Path, requested: str) -> dict[str, object]:
    """Activate, stage cuDNN, write image.json; returns its content."""
    names = installed(prefix)
    if not names:
        raise StageError(f"no backend venv under {prefix}")
    try:
        active = backends.resolve_active(names, requested)
    except backends.UnknownBackendError as exc:
        raise StageError(f"EP_ACTIVE={requested}: {exc}") from None
    activate(prefix, active)
    runtime = stage_cudnn.stage(prefix)
    stage_cudnn.record(prefix, runtime)
    record = image_record(prefix, backends.ep_value(names), names, active)
    write_json(prefix / "image.json", record)
    return record


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.Parser(
        prog=PROG,
        description="The Dockerfile's image-<EP> and final steps (see the module docstring).",
        epilog="Exit codes: 0 done; 1 the stage cannot do its job (the error names why and the "
        "fix); 2 bad usage.",
    )
    parser.add_argument("--prefix", type=Path, default=Path("/opt/venvs"))
    sub = parser.add_subparsers(dest="step", required=True)
    one = sub.add_parser(
        "assemble", help="copy and deduplicate the selected venvs, activate one, write records"
    )
    one.add_argument("backends", nargs="+", metavar="BACKEND")
    one.add_argument("--mounts", type=Path, default=Path("/mnt"))
    one.add_argument("--active", default="auto", help="the EP_ACTIVE build argument")
    one.add_argument(
        "--in-place",
        action="store_true",
        help="one backend whose venv is already under --prefix (the stage is FROM ep-BACKEND)",
    )
    sub.add_parser("manifest", help="write env-manifest.json with check-env")
    return parser.parse_args(argv)


#: What ``assemble`` writes beside the venvs (dedup's report included).
RECORDS = ("image.json", "te-build.json", "dedup.json")


def run(args: argparse.Namespace) -> int:
    try:
        if args.step == "assemble":
            for name in RECORDS:
                if (why := not_a_file(args.prefix / name)) is not None:
                    raise StageError(f"{why}, where this step writes a record: remove it")
            assemble(args.backends, args.mounts, args.prefix, args.in_place)
            print("image_stage: " + json.dumps(finish(args.prefix, args.active)))
        else:
            manifest(args.prefix)
    except (StageError, backends.UnknownBackendError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)  # its one message names the fix
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return cli.run(PROG, parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
