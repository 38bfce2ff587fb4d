"""HybridEP (``deep_ep.HybridEPBuffer``): NVIDIA's hybrid-ep branch of DeepEP, source-built.

A package, not a module: beside its ``SPEC`` it holds the JIT cache its kernels need
(``jit_cache``: HybridEP compiles them in every process). The registry imports only this file.
"""

from ep_image.backends._spec import NVSHMEM, BackendSpec

SPEC = BackendSpec(
    name="hybridep",
    title="HybridEP (deep_ep.HybridEPBuffer, NVIDIA's hybrid-ep branch of DeepEP)",
    distribution="deep-ep",
    layout_marker="hybrid_ep_buffer.py",
    api="HybridEPBuffer",
    also_ships_markers_of=("deepep_v1",),
    builds_from_source=True,
    build_needs=(NVSHMEM,),
    links_nvshmem=True,
    internode_check="rdma",
    upstream_test="test_hybrid_ep.py",
    upstream_shape="env",
    # Measured at 2 and 4 ranks (evidence/2026-12-03), where its own test ran too; never at one.
    min_ranks=2,
    reads_build_variables=True,
    # Read by this package's jit_cache (HybridEP itself compiles into a per-process directory).
    jit_cache=("EP_HYBRIDEP_JIT_CACHE", "hybrid_ep"),
    build_hint=(
        "compiled from its pinned git commit, multi-node (HYBRID_EP_MULTINODE=1): needs git "
        "access to the commit and its NVIDIA/nccl submodule (GitHub, or a mirror through "
        "url.<mirror>.insteadOf), a CUDA toolkit with nvcc and the libcuda and NVML stubs, "
        "and rdma-core's headers (libibverbs-dev)"
    ),
)
