"""As hybridep_own_cache.py, and the process's own JIT directory is left as HybridEP leaves it."""

from typing import Any

from ep_image.probes._adapters.plugins import BUILTIN


class HybridEPOwnCacheKept(BUILTIN["hybridep"]):
    name = "hybridep"

    def create(self, group: Any, shape: Any) -> None:
        real = self.HybridEPBuffer
        self.HybridEPBuffer = lambda **kw: real(**{**kw, "load_cached_kernels": True})
        try:
            super().create(group, shape)
        finally:
            self.HybridEPBuffer = real

    def destroy(self) -> None:
        pass  # no clean-up of ours: HybridEP keeps its proc-<pid> directory
