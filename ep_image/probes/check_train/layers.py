"""Which layers the model runs: Transformer Engine's (fused attention, ``te.Linear``) or plain
torch's, and the ``model`` step that says so.

Why this module exists: the default training stack holds TE beside the backend, and the two had
never been loaded into one process: DeepEP v2 refuses to start beside a second libnccl, and TE
links NCCL and cuDNN too. Where TE is installed and a GPU is there, the model runs TE's layers,
in the same process as the backend, and a TE that does not load is a verdict with its cause
(check_te's reading of the failure) before any step is trained.
"""

from __future__ import annotations

import os
from typing import Any

from ep_image.probes import _installed, _te
from ep_image.probes._report import Status, Step, StepFailed, timed_step
from ep_image.probes.check_te.gpu_steps import FUSED_ONLY_ENV
from ep_image.probes.check_te.import_step import import_failure, unbounded_lookup_vars

#: TE's backward picks deterministic algorithms only (fused attention's included): the same
#: step with and without checkpointing can then be compared bit for bit.
DETERMINISTIC_ENV = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}


def step_model(mode: str, on_gpu: bool) -> tuple[Step, Any]:
    """The ``model`` step and TE's torch API (None: torch's layers). ``mode``: auto (TE where
    it is installed and a GPU is there), on (TE or nothing), off (torch's layers)."""
    te = None
    with timed_step("model") as step:
        found = _installed.dist_version(*_te.TE_DISTRIBUTIONS)
        installed = _installed.module_dir("transformer_engine") is not None
        step.data = {"te_mode": mode, "te_installed": installed, "te_version": found and found[1]}
        why_not = None
        if mode == "off":
            why_not = "--te off"
        elif not installed:
            why_not = "Transformer Engine is not installed in this environment"
        elif not on_gpu:
            why_not = "Transformer Engine needs a GPU"
        if why_not is not None and mode == "on":
            status = Status.MISSING if not installed else Status.SKIP
            raise StepFailed(
                status,
                f"--te on: {why_not}",
                "install TE (the `moe` extra) and run on a GPU node, or pass --te auto",
                step.data,
            )
        if why_not is None:
            te = _load_te(step.data)
            step.detail = (
                f"TE {step.data['te_version']} layers: fused attention (cuDNN), te.Linear; "
                "the experts' grouped GEMMs in torch"
            )
        else:
            step.detail = f"torch layers (SDPA attention, F.linear): {why_not}"
        step.data["layers"] = "te" if te is not None else "torch"
    return step, te


def _load_te(data: dict[str, Any]) -> Any:
    """Import TE's torch API with only its fused attention allowed and deterministic
    algorithms; a failure is the step's verdict (check_te reads its cause)."""
    os.environ.update(FUSED_ONLY_ENV)
    os.environ.update(DETERMINISTIC_ENV)
    ignored = unbounded_lookup_vars(os.environ)
    for name in ignored:
        del os.environ[name]
    data["te_lookup_env_ignored"] = ignored
    try:
        import transformer_engine.pytorch as te
    except Exception as exc:
        status, detail, hint = import_failure(f"{type(exc).__name__}: {exc}", gpu=True)
        raise StepFailed(status, detail, hint, data) from None
    return te
