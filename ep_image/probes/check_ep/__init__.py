"""check_ep: prove that an expert-parallel (EP) backend works, not just that it imports.

One probe in one package: the command line (``cli``) turns flags into options; on the rank
machinery (``_ranks``: launcher, supervisors, the backend process, the gates, the step loop,
the report) each rank runs check_ep's steps (``steps``: the kernel ``checks``) against a
plain-torch reference (``reference``) and the ``scenarios`` training presents, through the
backend's adapter (``_adapters``); what only check_ep reports is ``report``'s. Importing the
package is cheap and needs no torch; see docs/probes.md, section "check-ep".
"""

from __future__ import annotations

from ep_image.probes.check_ep.cli import main

__all__ = ["main"]
