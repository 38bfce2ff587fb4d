"""torch and the CUDA libraries it runs on, as this process loaded them: the versions torch
reports of itself, and the libnccl actually loaded (not the one torch was built against).
"""

from __future__ import annotations

from typing import Any

from ep_image.probes._cudnn_libs import decode_cudnn_version
from ep_image.probes._mapped import mapped_libraries


def loaded_nccl_version() -> str | None:
    """The version of the libnccl this process has loaded (``ncclGetVersion``), or None.

    Not ``torch.cuda.nccl.version()``: that is the NCCL torch was compiled against, which
    stays 2.28.9 on a machine whose torch loads a newer libnccl, and DeepEP v2's minimum
    is about the loaded library.
    """
    import ctypes

    mapped = mapped_libraries(r"^libnccl\.so")
    try:
        lib = ctypes.CDLL(mapped[0] if mapped else "libnccl.so.2")
        code = ctypes.c_int()
        if lib.ncclGetVersion(ctypes.byref(code)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    value = code.value
    major, minor, patch = (
        (value // 10000, value // 100 % 100, value % 100)
        if value >= 10000
        else (value // 1000, value // 100 % 10, value % 100)
    )
    return f"{major}.{minor}.{patch}"


def torch_facts() -> dict[str, Any]:
    """Versions torch reports about itself and its CUDA stack (imports torch)."""
    import torch

    facts: dict[str, Any] = {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "nccl": None,
        "cudnn": None,
    }
    facts["nccl"] = loaded_nccl_version()
    try:
        built = torch.cuda.nccl.version()
        facts["nccl_torch_built_with"] = (
            ".".join(map(str, built)) if isinstance(built, tuple) else str(built)
        )
    except Exception:
        facts["nccl_torch_built_with"] = None
    facts["nccl"] = facts["nccl"] or facts["nccl_torch_built_with"]
    try:
        cudnn = torch.backends.cudnn.version()
        facts["cudnn"] = "{}.{}.{}".format(*decode_cudnn_version(int(cudnn))) if cudnn else None
    except Exception:
        facts["cudnn"] = None
    if facts["cuda_available"]:
        facts["devices"] = [
            torch.cuda.get_device_name(i) for i in range(int(facts["device_count"]))
        ]
    return facts
