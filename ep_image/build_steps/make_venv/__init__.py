"""make_venv: one EP backend's venv under a prefix, from the committed uv.lock, atomically.

One package: the command and its three build modes, a venv, the image's skeletons, a skeleton
completed in place (``cli``); its command line and typed ``Options`` (``options``); one build per
prefix, under a temporary name, renamed into place (``atomic_venv``); the backend's extra synced,
a git source compiled against the venv's torch (``backend_sync``), its wheel exported or reused
(``backend_wheels``), the machine ready for that build (``source_prep``); bytecode identical
across venvs (``bytecode``); what a venv must pass before it moves into place (``venv_checks``);
its record (``venv_record``). These names are its public face; ``main`` is the ``make-venv``
entry point. See docs/host-mode.md.
"""

from __future__ import annotations

from ep_image.build_steps.make_venv.cli import EXIT_BUILD_FAILED, main, run
from ep_image.build_steps.make_venv.options import PROG, Mode, Options, parse_args

__all__ = ["EXIT_BUILD_FAILED", "PROG", "Mode", "Options", "main", "parse_args", "run"]
