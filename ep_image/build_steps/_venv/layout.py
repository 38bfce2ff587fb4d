"""A venv as the build steps lay it out: its one site-packages, the records it holds, and use-ep,
the script that makes one venv of a prefix the active one.

Why: make_venv writes a venv's record, the image's steps and check-installed read it, and every
step that looks inside a venv needs its site-packages; each names them here. Standard library
only.
"""

from __future__ import annotations

from pathlib import Path

from ep_image import SOURCE_ROOT

# A venv's record, written by ep_image.build_steps.make_venv and read by the image's steps: a
# finished backend venv, or (venvs-common) a skeleton without its backend's distribution.
VENV_RECORD = "ep-backend.json"
SKELETON_RECORD = "ep-skeleton.json"

#: The active-backend switch: POSIX sh, so that it runs before any Python (host mode, the image).
USE_EP = SOURCE_ROOT / "scripts" / "use-ep"


class VenvError(RuntimeError):
    """A directory that is not the venv the caller expected; the message says why."""


def site_packages(venv: Path) -> Path:
    """The venv's one ``lib/python3.X/site-packages``."""
    found = sorted(Path(venv).glob("lib/python3*/site-packages"))
    if len(found) != 1:
        raise VenvError(
            f"{venv}: expected one lib/python3*/site-packages, found {len(found)}: is it a venv? "
            "Create it with python3 -m ep_image.build_steps.make_venv or "
            "`uv sync --extra <backend>`."
        )
    return found[0]
