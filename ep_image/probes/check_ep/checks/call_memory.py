"""The peak memory of one backend call, above what was allocated when it began.

Why this module exists: a backend that falls back to gathering every rank's tokens (after a
missing capability) returns the right numbers and, while it runs, holds memory that grows with
the world size; one call's peak shows it. The CUDA allocator keeps peak statistics; torch's CPU
allocator keeps none, so on the CPU a dispatch mode follows the storage of every tensor the
call's torch operations create, from its creation until it is freed.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

T = TypeVar("T")

CUDA_HOW = "the CUDA allocator's peak statistics (torch.cuda.max_memory_allocated)"
CPU_HOW = (
    "the storages of the tensors the call's torch operations create, each counted until it is "
    "freed (a TorchDispatchMode: torch's CPU allocator keeps no statistics)"
)


@dataclasses.dataclass(frozen=True)
class CallMemory:
    """Bytes of one call: its peak above the start, and what it returned."""

    peak: int  # the most bytes allocated at once during the call, above the start
    returned: int  # bytes of the tensors it returned (held by the caller afterwards)
    how: str  # how ``peak`` was measured

    @property
    def beyond_output(self) -> int:
        """What the call held at its peak beyond the tensors it returned: its scratch."""
        return max(self.peak - self.returned, 0)


def returned_bytes(out: Any) -> int:
    """Bytes of the tensors a call returned: a tensor, or the tensor fields of a dataclass
    (dispatch's rows, their top-k indices and weights; the handle is the backend's own)."""
    if isinstance(out, torch.Tensor):
        return out.numel() * out.element_size()
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        fields = (getattr(out, f.name) for f in dataclasses.fields(out) if f.name != "handle")
        return sum(t.numel() * t.element_size() for t in fields if isinstance(t, torch.Tensor))
    return 0


def measure(fn: Callable[[], T], device: Any) -> tuple[T, CallMemory]:
    """``fn()`` and its memory: CUDA's allocator statistics on a GPU, followed storages on
    the CPU."""
    if getattr(device, "type", "cpu") == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        out = fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - start
        return out, CallMemory(max(peak, 0), returned_bytes(out), CUDA_HOW)
    with StorageTracker() as tracker:
        out = fn()
    return out, CallMemory(tracker.peak, returned_bytes(out), CPU_HOW)


class StorageTracker(TorchDispatchMode):
    """Counts the bytes of every storage an operation returns that none of its inputs held (a
    new allocation, not a view or an in-place result), until the storage is freed; ``peak`` is
    the most counted at once."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Else torch wraps __torch_dispatch__ for torch.compile, which imports dynamo (a second
        # or more) on the first call; nothing here is compiled.
        return False

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}  # storage id -> bytes
        self.refs: dict[int, weakref.ref[Any]] = {}
        self.now = 0
        self.peak = 0

    def _freed(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)
        self.refs.pop(key, None)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs, _ = tree_flatten((args, kwargs))
        held = {t.untyped_storage()._cdata for t in inputs if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        outputs, _ = tree_flatten(out)
        for t in outputs:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key, size = storage._cdata, storage.nbytes()
            if key in self.live:  # resized in place
                self.now += size - self.live[key]
                self.live[key] = size
            elif key not in held:
                self.live[key] = size
                self.now += size
                self.refs[key] = weakref.ref(storage, lambda _, k=key: self._freed(k))
        self.peak = max(self.peak, self.now)
        return out
