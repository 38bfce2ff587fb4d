"""Was the installed EP backend built for internode, judged from its files without importing it?

Why this module exists: each backend can be installed in a variant that imports and runs
intranode perfectly and has no internode path at all. DeepEP v1's setup.py drops its internode
and low-latency kernels when it finds no NVSHMEM (``-DDISABLE_NVSHMEM``); HybridEP compiles its
RDMA path only when ``HYBRID_EP_MULTINODE`` was set at build time; DeepEP v2 reaches other
nodes through NCCL's GIN, which needs NCCL >= 2.30.4. The evidence is in the installed files:

  DeepEP v1   deep_ep_cpp*.so needs libnvshmem_host.so.*           (ELF DT_NEEDED)
  HybridEP    hybrid_ep_cpp*.so needs libibverbs.so.1 + libmlx5.so.1 (DOCA path) or libnixl
              (NIXL path); the DOCA build also ships deep_ep/backend/nccl/obj/doca_gpunetio.o
  DeepEP v2   the nvidia-nccl wheel is >= 2.30.4

Nothing is imported or loaded: importing DeepEP v2 can end the process, and the question is
about the build, not about this machine's hardware.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ep_image import elf
from ep_image.probes import _ep_detect, _facts

#: NCCL that has the GIN device API DeepEP v2 uses across nodes (DeepEP's README).
V2_MIN_NCCL = (2, 30, 4)
REBUILD_HYBRIDEP = (
    "rebuild HybridEP for multi-node: pyproject.toml declares HYBRID_EP_MULTINODE=1 for deep-ep; "
    "a wheel built before that is reused from uv's cache, so run `uv cache clean deep-ep && uv "
    "sync --extra hybridep --reinstall-package deep-ep` (needs libibverbs-dev and the NCCL "
    "submodule: docs/backends.md)"
)
REBUILD_V1 = (
    "rebuild DeepEP v1 against NVSHMEM: make_venv.py builds it with NVSHMEM_DIR set to "
    "the venv's nvidia-nvshmem-cu13 (a build without it silently drops the internode and "
    "low-latency kernels)"
)
UPGRADE_NCCL = "install nvidia-nccl-cu13>=2.30.4 (the lock pins 2.30.7: uv sync --extra deepep_v2)"


def elf_needed(path: str | Path) -> list[str] | None:
    """The DT_NEEDED sonames of a 64-bit little-endian ELF file (what ``ldd`` starts from);
    None when the file is not such an ELF or cannot be read."""
    try:
        return list(elf.read_dynamic(path).needed)
    except (OSError, elf.ElfError):
        return None


def _needs(needed: list[str] | None, prefix: str) -> bool:
    return any(name.startswith(prefix) for name in needed or [])


def backend_internode(installed: _ep_detect.Installed | None = None) -> dict[str, Any]:
    """Whether the installed backend's build has its internode path, with the evidence.

    ``internode`` is True, False, or None (no backend installed, or nothing to judge by);
    ``hint`` names the fix when it is False.
    """
    inst = installed if installed is not None else _ep_detect.detect_installed()
    facts: dict[str, Any] = {
        "backend": inst.backend,
        "distribution": inst.distribution,
        "version": inst.version,
        "internode": None,
        "evidence": [],
        "hint": "",
    }
    check = (
        _ep_detect.registry.spec(inst.backend).internode_check
        if inst.backend in _ep_detect.BACKEND_NAMES
        else ""
    )
    if check == "nvshmem":
        ext = _facts.extension_path("deep_ep_cpp")
        needed = elf_needed(ext) if ext else None
        facts["extension"], facts["needed"] = ext, needed
        if needed is not None:
            facts["internode"] = _needs(needed, "libnvshmem_host.so")
            facts["evidence"].append(
                "deep_ep_cpp links libnvshmem_host (internode and low-latency kernels built)"
                if facts["internode"]
                else "deep_ep_cpp does not link libnvshmem_host: built without NVSHMEM"
            )
            facts["hint"] = "" if facts["internode"] else REBUILD_V1
    elif check == "rdma":
        ext = _facts.extension_path("hybrid_ep_cpp")
        needed = elf_needed(ext) if ext else None
        doca = (
            bool(inst.module_dir)
            and (Path(inst.module_dir) / "backend" / "nccl" / "obj" / "doca_gpunetio.o").is_file()
        )
        facts["extension"], facts["needed"], facts["doca_objects"] = ext, needed, doca
        if needed is not None:
            rdma = _needs(needed, "libibverbs.so") and _needs(needed, "libmlx5.so")
            nixl = _needs(needed, "libnixl")
            facts["internode"] = rdma or nixl
            facts["path"] = "nixl" if nixl else ("doca" if rdma else None)
            facts["evidence"].append(
                f"hybrid_ep_cpp links {'libnixl' if nixl else 'libibverbs + libmlx5'}"
                + (", DOCA objects shipped" if doca else "")
                if facts["internode"]
                else "hybrid_ep_cpp links neither libibverbs/libmlx5 nor libnixl: "
                "built without HYBRID_EP_MULTINODE (intranode only)"
            )
            facts["hint"] = "" if facts["internode"] else REBUILD_HYBRIDEP
    elif check == "nccl_gin":
        found = _facts.dist_version("nvidia-nccl-cu13", "nvidia-nccl-cu12")
        facts["nccl"] = found[1] if found else None
        ok = _facts.version_at_least(facts["nccl"], V2_MIN_NCCL)
        facts["internode"] = ok
        if ok is not None:
            want = ".".join(map(str, V2_MIN_NCCL))
            facts["evidence"].append(
                f"NCCL wheel {facts['nccl']} {'>=' if ok else '<'} {want} (NCCL GIN)"
            )
            facts["hint"] = "" if ok else UPGRADE_NCCL
    return facts
