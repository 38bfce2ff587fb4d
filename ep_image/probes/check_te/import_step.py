"""check_te's import step: load Transformer Engine's torch API and say why it did not load.

Why its own module: TE's import is where a foreign cuDNN, an empty ``CUDNN_PATH`` or a missing
GPU driver shows first, and each needs its own verdict and fix before any numeric check runs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ep_image.probes import _cudnn_libs, _installed, _te
from ep_image.probes._report import Status, Step, StepFailed, one_line, timed_step

#: The variables Transformer Engine's import searches for cuDNN, NVRTC and cuRAND, in its order
#: (transformer_engine/common/__init__.py, ``_load_cuda_library_from_system``): for each one that
#: is set, it globs ``<value>/**/lib<name>.so*`` recursively, and it skips only an *unset* one.
TE_LOOKUP_VARS = (
    *(f"{lib}_{kind}" for lib in ("CUDNN", "NVRTC", "CURAND") for kind in ("HOME", "PATH")),
    "CUDA_HOME",
    "CUDA_PATH",
)
INSTALL_HINT = (
    "install Transformer Engine built from source against this venv's cuDNN: "
    "python3 scripts/build_te.py (the `moe` extra pins it), or activate the image's venv"
)


def unbounded_lookup_vars(environ: Mapping[str, str]) -> dict[str, str]:
    """TE's lookup variables whose value would make its recursive glob walk the whole file
    system: empty (``docker run -e CUDNN_PATH=``; TE globs ``/**/libcudnn.so*``, through /proc
    and /sys, and its import never ends) or naming ``/`` itself."""
    return {
        name: environ[name]
        for name in TE_LOOKUP_VARS
        if name in environ and (not environ[name] or os.path.realpath(environ[name]) == "/")
    }


def import_failure(text: str, gpu: bool) -> tuple[Status, str, str]:
    """How a failed TE import ends: ``(status, detail, hint)``.

    A library bound to a cuDNN sub-library of another release (``undefined symbol ...,
    version libcudnn_graph.so.9``) is an error on any node, and its fix is the search path that
    found the other release, not TE's build. Anything else cannot be judged without a GPU (TE
    needs the driver to load); with one, TE's build is the suspect.
    """
    foreign = _cudnn_libs.foreign_sublibrary(text)
    if foreign is not None:
        return Status.ERROR, f"import failed: {one_line(text)}: {foreign[0]}", foreign[1]
    if not gpu:
        return (
            Status.SKIP,
            f"transformer_engine is installed but does not load without a GPU: {text}",
            "no GPU visible: run on a GPU node",
        )
    hint = INSTALL_HINT
    if "cudnn" in text.lower():
        hint = "TE and the loaded cuDNN disagree: " + INSTALL_HINT
    return Status.ERROR, f"import failed: {text}", hint


def step_import() -> tuple[Step, Any]:
    """Import TE's torch API; MISSING when TE is not installed at all.

    TE's lookup variables that would make its import search all of / are removed from this
    process's environment first, so that an empty one means unset here, as a user who wrote
    ``-e CUDNN_PATH=`` meant; TE itself skips only an unset one, so the step names them: TE in
    any other process would still hang on them.
    """
    te = None
    with timed_step("import") as step:
        found = _installed.dist_version(*_te.TE_DISTRIBUTIONS)
        module_dir = _installed.module_dir("transformer_engine")
        step.data = {
            "distribution": found[0] if found else None,
            "version": found[1] if found else None,
            "module_dir": str(module_dir) if module_dir else None,
        }
        if module_dir is None:
            raise StepFailed(
                Status.MISSING,
                "transformer_engine is not installed in this environment"
                + (f" (only the {found[0]} {found[1]} metadata is)" if found else ""),
                INSTALL_HINT,
                step.data,
            )
        ignored = unbounded_lookup_vars(os.environ)
        for name in ignored:
            del os.environ[name]
        step.data["lookup_env"] = {n: os.environ.get(n) for n in TE_LOOKUP_VARS}
        step.data["lookup_env_ignored"] = ignored
        note = ""
        if ignored:
            names = ", ".join(f"{n}={v!r}" for n, v in ignored.items())
            note = (
                f" ({names}: taken as unset here; unset them, since TE's own import searches "
                "all of / for such a value and never ends)"
            )
        import torch

        try:
            import transformer_engine
            import transformer_engine.pytorch as te
        except Exception as exc:
            text = f"{type(exc).__name__}: {exc}"
            status, detail, hint = import_failure(text, torch.cuda.is_available())
            raise StepFailed(status, detail + note, hint, step.data) from None
        step.data["version"] = getattr(transformer_engine, "__version__", step.data["version"])
        step.data["module_path"] = getattr(transformer_engine, "__file__", None)
        step.detail = (
            f"transformer_engine {step.data['version']} at {step.data['module_path']}; "
            f"torch {torch.__version__} (CUDA {torch.version.cuda}){note}"
        )
    return step, te
