"""The real DeepEP v1 adapter with one fault on one rank, for `check-ep --backend-class`.

Why: a probe's verdict on a broken backend is proven on a real one too, not only on the torch
reference with faults (tests/fixtures/broken_backends.py). Each class drives the image's own
DeepEP v1 buffers unchanged and corrupts what one rank gets back, so every other rank sees a
correct result and must still reach the report: the case that once hung in `scenarios` until
`--timeout` and ended as "unusable (exit 3)".
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ep_image.probes._adapters.plugins import BUILTIN

DeepEPv1 = BUILTIN["deepep_v1"]
FAULTY_RANK = 1


class NaNInOneCombinedRow(DeepEPv1):
    """Rank 1's combine returns a NaN in its first row (a kernel reading an unwritten slot)."""

    name = "deepep_v1_nan_row"

    def combine(self, y: torch.Tensor, handle: Any) -> torch.Tensor:
        out = super().combine(y, handle)
        if dist.get_rank() == FAULTY_RANK and out.shape[0] > 0:
            out = out.clone()
            out[0, 0] = float("nan")
        return out


class HalvedCombineOnOneRank(DeepEPv1):
    """Rank 1's combine is half the sum (an average where a sum belongs), on rank 1 only."""

    name = "deepep_v1_halved_combine"

    def combine(self, y: torch.Tensor, handle: Any) -> torch.Tensor:
        out = super().combine(y, handle)
        return out * 0.5 if dist.get_rank() == FAULTY_RANK else out
