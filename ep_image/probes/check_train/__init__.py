"""check_train: prove that an expert-parallel backend trains, not just that it exchanges.

A small MoE transformer (``model``) trained for a few steps on the backend (``exchange``,
``loop``), held step by step against the same model trained with the all-gather fallback, and
judged (``verdicts``) on what training shows: the loss, the gradients, the recompute of a
checkpointed layer, memory and speed. The rank machinery (launcher, supervisors, gates, the
step loop, the report of a run that died) is ``_ranks``', shared with check_ep, and the backends'
adapters ``_adapters``'. Importing the package needs no torch; see docs/probes.md, section
"check-train".
"""

from __future__ import annotations

from ep_image.probes.check_train.cli import main

__all__ = ["main"]
