"""ep_image: the build system for MoE training images with a selectable EP backend.

One package: the library at the top (``cli``, ``pins``, ``backends``, ``native``, ``files``,
``repo``), the build steps in ``ep_image.build_steps`` and the probes in ``ep_image.probes``;
docs/architecture.md draws the parts.
Standard library only: it runs in backend venvs that hold only the lock's packages and on bare
base images.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

#: The directory that holds this package: the repository root, or /opt/ep-image in the image.
SOURCE_ROOT = Path(__file__).resolve().parent.parent


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with this package first on PYTHONPATH, so that a child
    Python (a rank, an upstream test) imports the same ep_image even from a venv without it."""
    out = dict(os.environ if env is None else env)
    parts = [str(SOURCE_ROOT), *filter(None, out.get("PYTHONPATH", "").split(os.pathsep))]
    out["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    return out
