"""build_te: source-build Transformer Engine (TE) against the cuDNN inside a uv venv, once per
image or host, and record it in ``te-build.json``.

One package: the command, its plan and the record (``cli``), the TE source tree: what it lacks,
which commit, the clone of the pin (``source``), and what TE compiles in: the build venv from
the lock, its tools, the variables TE's build reads (``environment``). These names are its
public face; ``main`` is the ``build-te`` entry point. See docs/image.md, section "Transformer
Engine and the cuDNN it was built against".
"""

from __future__ import annotations

from ep_image.build_steps.build_te.cli import PROG, main, parse_args, run
from ep_image.build_steps.build_te.source import BuildTeError

__all__ = ["PROG", "BuildTeError", "main", "parse_args", "run"]
