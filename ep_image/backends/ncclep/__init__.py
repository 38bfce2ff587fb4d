"""NCCL EP (``nccl.ep``): NCCL's own expert-parallel library, NVIDIA's nccl-extensions wheel.

A package, not a module: beside its ``SPEC`` it holds what the probes read of its native
library without importing it (``library``: which libnccl_ep.so the wheel loads, its release,
the libnccl.so.2 it binds to, what its JIT runtime reads). The registry imports only this file.
"""

from ep_image.backends._spec import BackendSpec, Provider

SPEC = BackendSpec(
    name="ncclep",
    title=("NCCL EP (nccl.ep.Group, NCCL's expert-parallel library; JIT: needs nvcc at run time)"),
    distribution="nccl-extensions",
    module="nccl.ep",
    # nccl4py owns nccl.core and nccl.bindings in the same namespace; nccl.ep is this wheel's.
    layout_marker="group.py",
    api="Group",
    providers=(
        Provider(
            "nccl-extensions",
            "ncclep",
            upstream="https://github.com/NVIDIA/nccl-extensions",
            no_commit="unknown: NVIDIA's PyPI wheel of nccl-extensions records no commit",
        ),
    ),
    # Across nodes its high-throughput kernels run on NCCL GIN (GPU-initiated networking).
    internode_check="nccl_gin",
    # It builds its own NCCL communicator from the process group: ranks cannot share a GPU.
    shares_gpu=False,
    # Its JIT's default, /tmp/nccl_ep/jit, is shared by every user of a machine.
    jit_cache=("NCCL_EP_JIT_CACHE_DIR", "nccl_ep"),
    facts_module="library",
)
