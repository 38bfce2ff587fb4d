"""HybridEP with its own kernel cache only, for `check-ep --backend-class`.

Why: to measure whether HybridEP's own cache does the job of the project's
(ep_image/backends/hybridep/jit_cache.py). Run with EP_HYBRIDEP_JIT_CACHE=off (the project's
cache out of the way) and HYBRID_EP_CACHE_DIR at one directory for every process, the way a
bridge such as NeMo AutoModel's points it; the buffer is built with load_cached_kernels=True,
so HybridEP loads whatever its own directory already holds.
"""

from __future__ import annotations

from typing import Any

from ep_image.probes._adapters.plugins import BUILTIN


class HybridEPOwnCache(BUILTIN["hybridep"]):
    """The image's HybridEP adapter, its buffer built with ``load_cached_kernels=True``."""

    # The registry's name: the adapter finds the backend's modules by it.
    name = "hybridep"

    def create(self, group: Any, shape: Any) -> None:
        real = self.HybridEPBuffer

        def own_cache(**kwargs: Any) -> Any:
            return real(**{**kwargs, "load_cached_kernels": True})

        self.HybridEPBuffer = own_cache
        try:
            super().create(group, shape)
        finally:
            self.HybridEPBuffer = real
