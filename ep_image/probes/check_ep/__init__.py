"""check_ep: prove that an expert-parallel (EP) backend works, not just that it imports.

One probe in one package: the command line (``cli``) turns flags into options, each rank's
supervisor (``supervisor``) watches a backend process (``worker``) that runs the steps
(``steps``, ``gates``, ``checks``) against a plain-torch reference (``reference``), and rank 0
writes the verdict (``output``). Importing the package is cheap and needs no torch; see
docs/probes.md, section "check-ep".
"""

from __future__ import annotations

from ep_image.probes.check_ep.cli import main

__all__ = ["main"]
