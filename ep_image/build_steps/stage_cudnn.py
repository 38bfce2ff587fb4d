#!/usr/bin/env python3
"""Put the venv's cuDNN ahead of the base image's copy, and record both versions.

Why: TE is compiled against the venv's cuDNN; loading the base image's instead fails late.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from ep_image import cli
from ep_image.build_steps._te_wheels import TE_RECORD
from ep_image.build_steps._venv.cudnn import CudnnError, find_cudnn, read_cudnn_version
from ep_image.files.records import write_json

LDCONF = Path("/etc/ld.so.conf.d/000-ep-venv-cudnn.conf")
SONAME = "libcudnn.so.9"
BASE_HEADERS = (
    "/usr/include/cudnn_version.h",
    "/usr/include/x86_64-linux-gnu/cudnn_version_v9.h",
    "/usr/local/cuda/include/cudnn_version.h",
)


def ldconfig_entries(soname: str) -> list[str]:
    """Paths `ldconfig -p` lists for soname, in the order the loader tries them."""
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=True).stdout
    pattern = re.compile(rf"^\s*{re.escape(soname)}\s.*=>\s*(\S+)\s*$")
    return [m.group(1) for line in out.splitlines() if (m := pattern.match(line))]


def base_image_cudnn(prefix: Path) -> dict[str, object]:
    """The base image's own cuDNN: version from its header, libraries from ldconfig."""
    libs = [p for p in ldconfig_entries(SONAME) if not p.startswith(str(prefix))]
    version = None
    for header in map(Path, BASE_HEADERS):
        if header.is_file():
            version = read_cudnn_version(header)
            break
    if version is None and libs:
        match = re.search(r"\.so\.(\d+\.\d+\.\d+)$", os.path.realpath(libs[0]))
        version = match.group(1) if match else None
    return {"version": version, "libs": libs, "present": bool(libs or version)}


def link_active(prefix: Path, venv: Path, cudnn_root: Path) -> Path:
    """<prefix>/active-cudnn -> active/<path of nvidia/cudnn inside the venv> (relative)."""
    link = prefix / "active-cudnn"
    target = Path("active") / cudnn_root.relative_to(venv)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target, target_is_directory=True)
    return link


def stage(prefix: Path) -> dict[str, object]:
    """Link, configure the loader, verify; return the cudnn_runtime record.

    A CUDA "cudnn" base image carries its own, usually different, cuDNN in the linker's default
    path; if that one is loaded, TE calls into a cuDNN it was not built for and fails in
    fused-attention backward, not at import. So the image's final stage (image_stage.py finish):

    - links ``<prefix>/active-cudnn`` to the active venv's ``site-packages/nvidia/cudnn``
      (through ``<prefix>/active``, so ``use-ep --activate`` follows along), which the
      Dockerfile puts first on LD_LIBRARY_PATH and in CUDNN_PATH/CUDNN_HOME;
    - lists ``<prefix>/active-cudnn/lib`` in ``/etc/ld.so.conf.d/000-ep-venv-cudnn.conf`` and runs
      ldconfig, so processes that drop LD_LIBRARY_PATH still resolve the venv's copy first;
    - checks that ``ldconfig -p`` now resolves ``libcudnn.so.9`` to the venv, else fails;
    - ``record`` then adds this as ``cudnn_runtime`` to ``<prefix>/te-build.json``: the venv's
      cuDNN version (what TE was built against) next to the base image's (what is shadowed).
    """
    venv = (prefix / "active").resolve()
    try:
        cudnn = find_cudnn(venv)
    except CudnnError as err:
        # Only a test image built with VENV_SKIP_PACKAGES lacks it; say so in the record.
        print(f"stage_cudnn: warning: {err}", file=sys.stderr)
        base = base_image_cudnn(prefix)
        return {"staged": False, "reason": str(err), "base_image": base}
    link = link_active(prefix, venv, cudnn.root)
    LDCONF.write_text(f"# venv cuDNN first (ep_image.build_steps.stage_cudnn)\n{link / 'lib'}\n")
    subprocess.run(["ldconfig"], check=True)
    entries = ldconfig_entries(SONAME)
    if not entries or not entries[0].startswith(str(link)):
        raise cli.FixableError(
            f"ldconfig resolves {SONAME} to {entries[:1]}, not {link}/lib",
            f"make sure {LDCONF} sorts before the base image's ld.so.conf.d entries",
        )
    return {
        "staged": True,
        "venv_version": cudnn.version,
        "venv_dist_version": cudnn.dist_version,
        "venv_lib": str(link / "lib"),
        "venv_lib_resolved": str(cudnn.lib),
        "ldconfig_order": entries,
        "ld_library_path_first": str(link / "lib"),
        "base_image": base_image_cudnn(prefix),
    }


def record(prefix: Path, runtime: dict[str, object]) -> None:
    """Add cudnn_runtime to <prefix>/te-build.json (kept next to what TE was built against)."""
    path = prefix / TE_RECORD
    data = json.loads(path.read_text()) if path.is_file() else {}
    built = data.get("cudnn_version")
    if built and runtime.get("staged") and built != runtime["venv_version"]:
        raise cli.FixableError(
            f"TE was built against cuDNN {built} but the venv holds {runtime['venv_version']}",
            "rebuild the te stage from the same uv.lock",
        )
    data["cudnn_runtime"] = runtime
    write_json(path, data)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.Parser(prog="stage_cudnn", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--prefix", type=Path, default=Path("/opt/venvs"), help="the venvs (default /opt/venvs)"
    )
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    runtime = stage(args.prefix)
    record(args.prefix, runtime)
    print("stage_cudnn: " + json.dumps(runtime))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return cli.run("stage_cudnn", parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
