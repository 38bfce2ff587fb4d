"""The adapter of DeepEP v2's ``deep_ep.ElasticBuffer`` (non-expanded layout, CPU-synced counts),
and the facts of its JIT cache.

Why this module exists: v2 pads its received rows to a buffer size and compiles its kernels at
first use; the adapter cuts the rows to the real count and reports where the kernels are cached
and whether NCCL GIN is on.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ep_image.probes._adapters.base import Dispatched, EPBackend, Shape
from ep_image.probes._adapters.deep_ep_common import (
    RowsHandle,
    import_deep_ep,
    module_facts,
    pad_rows,
)


def jit_cache_path(env: dict[str, str] | None = None) -> str:
    """Where DeepEP v2 keeps its compiled kernels: EP_JIT_CACHE_DIR, else ~/.deep_ep."""
    env = dict(os.environ if env is None else env)
    home = env.get("HOME") or os.path.expanduser("~")
    return env.get("EP_JIT_CACHE_DIR") or os.path.join(home, ".deep_ep")


def jit_cache_facts(env: dict[str, str] | None = None) -> dict[str, Any]:
    """DeepEP v2's JIT cache before this run: where, how many kernels it holds. An empty one
    means minutes of compiling at first dispatch; a container that keeps it (a volume, the
    image's EP_JIT_CACHE_DIR) pays that once."""
    env = dict(os.environ if env is None else env)
    where = jit_cache_path(env)
    files, size = 0, 0
    for root, _dirs, names in os.walk(where):
        for name in names:
            try:
                size += os.lstat(os.path.join(root, name)).st_size
                files += 1
            except OSError:
                continue
    gin_off = env.get("EP_DISABLE_GIN", "0") not in ("", "0")
    return {
        "jit_cache_dir": where,
        "jit_cache_from": "EP_JIT_CACHE_DIR" if env.get("EP_JIT_CACHE_DIR") else "default",
        "jit_cache_files_before": files,
        "jit_cache_bytes_before": size,
        "gin": "disabled (EP_DISABLE_GIN=1: NVLink only, one node)" if gin_off else "enabled",
    }


class DeepEPv2Backend(EPBackend):
    """DeepEP v2 ``deep_ep.ElasticBuffer`` (non-expanded layout, CPU-synced counts).

    Its kernels are JIT-compiled on first use (CUDA home with nvcc and cuobjdump needed) and
    its import requires NCCL >= 2.30 (``ncclCommQueryProperties``).
    """

    name = ""  # the backend's, given by adapter_for
    api = "ElasticBuffer"
    jit_compiles = True
    # Its JIT compiles each kernel to a cubin with $CUDA_HOME/bin/nvcc (csrc/jit/compiler.hpp),
    # and every kernel it loads, compiled now or found in its cache, goes through
    # `$CUDA_HOME/bin/cuobjdump -symbols kernel.cubin` (csrc/jit/kernel_runtime.hpp), in
    # sgl-deep-ep 0.1.2.post1 as at upstream af9a0403. A CUDA home without cuobjdump failed the
    # first dispatch on an H200: "Assertion exception (kernel_runtime.hpp:33): exit_code == 0".
    jit_tools = ("nvcc", "cuobjdump")
    min_nccl = (2, 30)
    needs_nccl_group = True

    def jit_cache_dir(self) -> Path | None:
        return Path(jit_cache_path())

    def load(self) -> dict[str, Any]:
        self.deep_ep = import_deep_ep()
        self.ElasticBuffer = self.deep_ep.ElasticBuffer
        self.topk_idx_t = getattr(self.deep_ep, "topk_idx_t", torch.int64)
        return {**module_facts(self.deep_ep), **jit_cache_facts()}

    def create(self, group: dist.ProcessGroup, shape: Shape) -> None:
        self.shape = shape
        # Sized from the MoE settings (BF16 tokens), as ElasticBuffer computes it.
        self.buffer = self.ElasticBuffer(
            group,
            num_max_tokens_per_rank=shape.tokens,
            hidden=shape.hidden,
            num_topk=shape.topk,
            explicitly_destroy=True,
        )

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> Dispatched:
        recv_x, recv_idx, recv_w, handle, _ = self.buffer.dispatch(
            x,
            topk_idx=topk_idx.to(self.topk_idx_t),
            topk_weights=topk_weights.float(),
            num_experts=self.shape.experts,
            num_max_tokens_per_rank=self.shape.tokens,
        )
        # Received rows may be padded to a buffer size; the prefix sum's last element is
        # the real count (DeepEP's own test reads it the same way).
        rows = int(handle.psum_num_recv_tokens_per_scaleup_rank[-1].item())
        return Dispatched(
            recv_x=recv_x[:rows],
            recv_topk_idx=recv_idx[:rows],
            recv_topk_weights=recv_w[:rows],
            num_recv_per_expert=[int(c) for c in handle.num_recv_tokens_per_expert_list],
            handle=RowsHandle(handle, rows, recv_x.shape[0]),
        )

    def combine(self, y: torch.Tensor, handle: RowsHandle) -> torch.Tensor:
        combined, _, _ = self.buffer.combine(pad_rows(y, handle.padded_rows), handle.raw)
        return combined

    def dispatch_backward_with_weights(
        self, grad_recv_x: torch.Tensor, grad_recv_topk_weights: torch.Tensor, handle: RowsHandle
    ) -> tuple[torch.Tensor, torch.Tensor]:
        grad_x, grad_w, _ = self.buffer.combine(
            pad_rows(grad_recv_x, handle.padded_rows),
            handle.raw,
            topk_weights=pad_rows(grad_recv_topk_weights.float(), handle.padded_rows),
        )
        return grad_x, grad_w

    def dispatch_cached(self, x: torch.Tensor, handle: RowsHandle) -> torch.Tensor:
        # num_experts is passed although the handle holds it: dispatch sizes its SM count
        # from it before it reads the handle.
        recv_x, _, _, _, _ = self.buffer.dispatch(
            x, handle=handle.raw, num_experts=self.shape.experts
        )
        return recv_x[: handle.rows]

    def destroy(self) -> None:
        buffer = getattr(self, "buffer", None)
        if buffer is not None:
            buffer.destroy()
            self.buffer = None
