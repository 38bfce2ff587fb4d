"""check_te: prove that Transformer Engine (TE) works here, fused attention backward included.

Importing TE proves nothing about the cuDNN it meets at run time: this probe compares the cuDNN
TE was built against with the one loaded, then checks fused attention and ``te.Linear``, forward
and backward, against plain torch in fp32. One package: the command (``cli``), TE's import
(``import_step``), the cuDNN TE was built against and the one loaded (``cudnn_step``), and the
numbers on the GPU (``gpu_steps``); these names are its public face. See docs/probes.md,
section "check-te".
"""

from __future__ import annotations

from ep_image.probes._report import StepFailed
from ep_image.probes.check_te.cli import STEP_NAMES, main, parse_args, run
from ep_image.probes.check_te.cudnn_step import compare_cudnn, step_cudnn
from ep_image.probes.check_te.gpu_steps import step_fused_attention, step_linear
from ep_image.probes.check_te.import_step import import_failure, step_import, unbounded_lookup_vars

__all__ = [
    "STEP_NAMES",
    "StepFailed",
    "compare_cudnn",
    "import_failure",
    "main",
    "parse_args",
    "run",
    "step_cudnn",
    "step_fused_attention",
    "step_import",
    "step_linear",
    "unbounded_lookup_vars",
]
