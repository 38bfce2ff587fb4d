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

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ep_image.native import elf
from ep_image.probes import _backend_detect, _installed, _versions

#: NCCL that has the GIN device API DeepEP v2 uses across nodes (DeepEP's README).
V2_MIN_NCCL = (2, 30, 4)


def rebuild_multinode(backend: str) -> str:
    """The fix for an ``rdma`` build made without its multi-node path."""
    return (
        f"rebuild {backend} for multi-node: pyproject.toml declares HYBRID_EP_MULTINODE=1 for "
        "deep-ep; a wheel built before that is reused from uv's cache, so run `uv cache clean "
        f"deep-ep && uv sync --extra {backend} --reinstall-package deep-ep` (needs "
        "libibverbs-dev and the NCCL submodule: docs/backends.md)"
    )


def rebuild_with_nvshmem(backend: str) -> str:
    """The fix for an ``nvshmem`` build made without NVSHMEM."""
    return (
        f"rebuild {backend} against NVSHMEM: python3 scripts/make_venv.py builds it with "
        "NVSHMEM_DIR set to the venv's nvidia-nvshmem-cu13 (a build without it silently drops "
        "the internode and low-latency kernels)"
    )


def upgrade_nccl(backend: str) -> str:
    """The fix for an ``nccl_gin`` backend next to an NCCL without GIN."""
    want = ".".join(map(str, V2_MIN_NCCL))
    return f"install nvidia-nccl-cu13>={want} (the lock pins one: uv sync --extra {backend})"


def elf_needed(path: str | Path) -> list[str] | None:
    """The DT_NEEDED sonames of a 64-bit little-endian ELF file (what ``ldd`` starts from);
    None when the file is not such an ELF or cannot be read."""
    try:
        return list(elf.read_dynamic(path).needed)
    except (OSError, elf.ElfError):
        return None


def _needs(needed: list[str] | None, prefix: str) -> bool:
    return any(name.startswith(prefix) for name in needed or [])


def backend_internode(installed: _backend_detect.Installed | None = None) -> dict[str, Any]:
    """Whether the installed backend's build has its internode path, with the evidence.

    ``internode`` is True, False, or None (no backend installed, or nothing to judge by);
    ``hint`` names the fix when it is False.
    """
    inst = installed if installed is not None else _backend_detect.detect_installed()
    facts: dict[str, Any] = {
        "backend": inst.backend,
        "distribution": inst.distribution,
        "version": inst.version,
        "internode": None,
        "evidence": [],
        "hint": "",
    }
    check = (
        _backend_detect.registry.spec(inst.backend).internode_check
        if inst.backend in _backend_detect.BACKEND_NAMES
        else ""
    )
    if check:
        CHECKS[check](inst, facts)
    return facts


def _links_nvshmem(inst: _backend_detect.Installed, facts: dict[str, Any]) -> None:
    """DeepEP v1's extension links libnvshmem_host: its internode and low-latency kernels."""
    ext = _installed.extension_path("deep_ep_cpp")
    needed = elf_needed(ext) if ext else None
    facts["extension"], facts["needed"] = ext, needed
    if needed is not None:
        facts["internode"] = _needs(needed, "libnvshmem_host.so")
        facts["evidence"].append(
            "deep_ep_cpp links libnvshmem_host (internode and low-latency kernels built)"
            if facts["internode"]
            else "deep_ep_cpp does not link libnvshmem_host: built without NVSHMEM"
        )
        facts["hint"] = "" if facts["internode"] else rebuild_with_nvshmem(inst.backend)


def _links_rdma(inst: _backend_detect.Installed, facts: dict[str, Any]) -> None:
    """HybridEP's extension links libibverbs + libmlx5 (DOCA) or NIXL: a multi-node build."""
    ext = _installed.extension_path("hybrid_ep_cpp")
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
        facts["hint"] = "" if facts["internode"] else rebuild_multinode(inst.backend)


def _nccl_gin(inst: _backend_detect.Installed, facts: dict[str, Any]) -> None:
    """DeepEP v2 goes across nodes through NCCL GIN: the venv's NCCL must be new enough."""
    found = _installed.dist_version("nvidia-nccl-cu13", "nvidia-nccl-cu12")
    facts["nccl"] = found[1] if found else None
    ok = _versions.version_at_least(facts["nccl"], V2_MIN_NCCL)
    facts["internode"] = ok
    if ok is not None:
        want = ".".join(map(str, V2_MIN_NCCL))
        facts["evidence"].append(
            f"NCCL wheel {facts['nccl']} {'>=' if ok else '<'} {want} (NCCL GIN)"
        )
        facts["hint"] = "" if ok else upgrade_nccl(inst.backend)


#: ``BackendSpec.internode_check`` -> the check that fills in ``facts`` (a test holds the keys
#: equal to ep_image.backends.INTERNODE_CHECKS).
CHECKS: dict[str, Callable[[_backend_detect.Installed, dict[str, Any]], None]] = {
    "nvshmem": _links_nvshmem,
    "rdma": _links_rdma,
    "nccl_gin": _nccl_gin,
}
