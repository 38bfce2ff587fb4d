"""dedup: hardlink identical regular files across directory trees (per-backend venvs), so that N
venvs that carry the same torch and CUDA libraries cost about one.

One package: the command and the order of a run (``cli``), util-linux ``hardlink`` driven
(``hardlink``), ``--read-only``'s write bits and their journal (``read_only``), the report in
``du``'s terms (``report``), what a killed run left (``leftovers``), a tree on overlayfs
(``overlay``), and the walk they all book with (``tree``). These names are its public face:
``main`` for the ``dedup`` entry point, ``command`` for the build steps that run it as a child.
See docs/host-mode.md, section "Deduplicating venvs".
"""

from __future__ import annotations

from ep_image.build_steps.dedup.cli import (
    DEFAULT_EXCLUDES,
    PROG,
    SYSTEM_TREES,
    command,
    dedup,
    is_excluded,
    lock_roots,
    main,
    parse_args,
    resolve_roots,
    run,
)
from ep_image.build_steps.dedup.report import Report
from ep_image.build_steps.dedup.tree import DedupError

__all__ = [
    "DEFAULT_EXCLUDES",
    "PROG",
    "SYSTEM_TREES",
    "DedupError",
    "Report",
    "command",
    "dedup",
    "is_excluded",
    "lock_roots",
    "main",
    "parse_args",
    "resolve_roots",
    "run",
]
