"""The pinned uv: the release that wrote uv.lock, and where the build steps find it.

Why: uv.lock was written by one uv release, and CI, the image and the README install exactly
that one. The version is written here once; ``.ci/run``, ci.yml, the Dockerfile's ``UV_VERSION``
ARG and README repeat it for tools that cannot import Python, and a test holds them equal.
``ep_image/build_steps/bootstrap.py`` installs it where none is on PATH; ``find_uv`` looks there
too, so a command chained after the bootstrap finds it without touching PATH.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

#: The uv that wrote uv.lock.
UV_VERSION = "0.13.9"


class ToolError(RuntimeError):
    """A tool is missing; the message says how to install it."""


def bootstrap_dir(version: str = UV_VERSION) -> Path:
    """Where bootstrap.py installs uv: ``$XDG_CACHE_HOME/ep-image/uv-<version>/bin``."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "ep-image" / f"uv-{version}" / "bin"


def find_uv() -> str:
    """uv on PATH, else the one bootstrap.py installed; else ToolError naming the fix."""
    found = shutil.which("uv")
    if found:
        return found
    candidate = bootstrap_dir() / "uv"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    raise ToolError(
        f"uv not found on PATH. Install uv {UV_VERSION}, the version that wrote uv.lock and that "
        "README and CI use: `python3 scripts/bootstrap.py` "
        f"(from PyPI, into {candidate.parent}), "
        f"or `python3 -m pip install uv=={UV_VERSION}`"
    )
