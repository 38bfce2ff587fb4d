"""Find the cuDNN a venv's nvidia-cudnn-cu13 wheel installed: headers, libraries, version.

Why: build_te compiles TE against that cuDNN and stage_cudnn puts it first at run time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ep_image.build_steps._venv.layout import VenvError, site_packages

CUDNN_DIST = "nvidia-cudnn-cu13"
FIX_CUDNN = (
    f"install it into the venv from the lock: `uv sync --frozen --extra moe "
    f"--no-install-package transformer-engine` (the moe extra pins {CUDNN_DIST}), or "
    f"`uv pip install --python VENV/bin/python {CUDNN_DIST}==<version in uv.lock>`"
)


class CudnnError(RuntimeError):
    """The venv holds no usable cuDNN; the message says how to fix it."""


@dataclass(frozen=True)
class Cudnn:
    """The cuDNN a venv's nvidia-cudnn-cu13 wheel installed."""

    root: Path
    include: Path
    lib: Path
    version: str
    dist_version: str


def dist_version(site: Path, dist: str) -> str | None:
    """Version of an installed distribution, read from its .dist-info directory name."""
    normalized = re.sub(r"[-_.]+", "_", dist).lower()
    for info in site.glob("*.dist-info"):
        name, _, version = info.name.removesuffix(".dist-info").rpartition("-")
        if re.sub(r"[-_.]+", "_", name).lower() == normalized:
            return version
    return None


def read_cudnn_version(header: Path) -> str:
    """MAJOR.MINOR.PATCHLEVEL from cudnn_version.h's #defines."""
    text = header.read_text(encoding="utf-8", errors="replace")
    parts = []
    for macro in ("CUDNN_MAJOR", "CUDNN_MINOR", "CUDNN_PATCHLEVEL"):
        match = re.search(rf"^\s*#\s*define\s+{macro}\s+(\d+)\b", text, re.MULTILINE)
        if match is None:
            raise CudnnError(
                f"{header} defines no {macro}: not a cuDNN version header. "
                f"Fix: reinstall {CUDNN_DIST} in the venv."
            )
        parts.append(match.group(1))
    return ".".join(parts)


def find_cudnn(venv: Path) -> Cudnn:
    """Headers, libraries and version of the venv's nvidia-cudnn-cu13; a CudnnError naming the
    fix when ``venv`` is not a venv with one site-packages or lacks that wheel."""
    if not (venv / "pyvenv.cfg").is_file():
        raise CudnnError(
            f"{venv} is not a virtual environment (no pyvenv.cfg). "
            "Fix: pass --venv the directory `uv sync` created (e.g. .venv)."
        )
    try:
        site = site_packages(venv)
    except VenvError as exc:
        raise CudnnError(
            f"{exc} Fix: recreate the venv with one Python (`uv venv --python 3.12`)."
        ) from None
    installed = dist_version(site, CUDNN_DIST)
    if installed is None:
        raise CudnnError(f"{CUDNN_DIST} is not installed in {venv}. Fix: {FIX_CUDNN}.")
    root = site / "nvidia" / "cudnn"
    include, lib = root / "include", root / "lib"
    header = include / "cudnn_version.h"
    if not header.is_file() or not any(lib.glob("libcudnn.so*")):
        raise CudnnError(
            f"{CUDNN_DIST} {installed} is registered in {venv} but {header} or "
            f"{lib}/libcudnn.so* is missing (a partial install). Fix: reinstall it: "
            f"`uv pip install --python {venv}/bin/python --reinstall {CUDNN_DIST}=={installed}`."
        )
    return Cudnn(root, include, lib, read_cudnn_version(header), installed)
