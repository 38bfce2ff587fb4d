"""The adapter of HybridEP's ``deep_ep.HybridEPBuffer`` (NVIDIA's hybrid-ep branch), non-permuted
API, and its translation between top-k indices and routing maps.

Why this module exists: HybridEP takes and returns a routing map (token x expert) where the other
backends speak top-k indices; the adapter translates both ways so the same checks apply, and
keeps HybridEP's JIT kernels across processes (the backend's ``jit_cache`` module).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from ep_image import backends as registry
from ep_image.probes._adapters.base import UNEVEN_TOKENS, Dispatched, EPBackend, Shape
from ep_image.probes._adapters.deep_ep_common import (
    RowsHandle,
    import_deep_ep,
    module_facts,
    pad_rows,
)


@dataclasses.dataclass
class HybridHandle(RowsHandle):
    """HybridEP's handle, with what the weights' gradient needs: the routing sent, the local
    indices received and the width of the probs dispatch returned (the NVLink domain's
    experts)."""

    topk_idx: Any = None  # [tokens, topk] as sent
    recv_topk_idx: Any = None  # [rows, topk] local indices, -1 elsewhere
    probs_width: int = 0


class HybridEPBackend(EPBackend):
    """HybridEP ``deep_ep.HybridEPBuffer`` (NVIDIA's hybrid-ep branch), non-permuted API.

    HybridEP returns a routing map (token x local expert) instead of top-k indices; the
    adapter turns it back into ``recv_topk_idx`` so the same checks apply. It JIT-compiles
    its kernels (CUDA home with nvcc needed).
    """

    name = ""  # the backend's, given by adapter_for
    api = "HybridEPBuffer"
    jit_compiles = True
    input_limits: ClassVar[dict[str, str]] = {
        UNEVEN_TOKENS: "HybridEPBuffer.dispatch takes one token count for every rank (it "
        "all-gathers the routing map as num_of_tokens_per_rank x ranks rows, "
        "Executor::allgather_routing_map at e0a5b1d9), so every rank must pass the same "
        "number of tokens",
    }

    def load(self) -> dict[str, Any]:
        self.deep_ep = import_deep_ep()
        self.HybridEPBuffer = self.deep_ep.HybridEPBuffer
        return module_facts(self.deep_ep)

    def create(self, group: dist.ProcessGroup, shape: Shape) -> None:
        self.shape = shape
        self.local = shape.local_experts(group.size())
        # Kernels compiled by earlier processes, from EP_HYBRIDEP_JIT_CACHE: HybridEP itself
        # compiles into a directory of this process's own (the backend's jit_cache module).
        self.jit = registry.module_of(self.name, "jit_cache").prepare(
            arch=torch.cuda.get_device_capability(),
            package_dir=os.path.dirname(self.deep_ep.__file__),
        )
        self._published = False
        self.buffer = self.HybridEPBuffer(
            group=group,
            hidden_dim=shape.hidden,
            max_num_of_tokens_per_rank=shape.tokens,
            num_local_experts=self.local,
            use_fp8=False,
            load_cached_kernels=self.jit.load_cached_kernels,
        )

    def facts(self) -> dict[str, Any]:
        return self.jit.facts() if getattr(self, "jit", None) else {}

    def destroy(self) -> None:
        jit = getattr(self, "jit", None)
        if jit is not None:
            jit.close()  # publishes what backward compiled, removes this process's directory

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> Dispatched:
        route: dict[str, Any] = {
            "topk_idx": topk_idx.to(torch.int64),
            "topk_weights": topk_weights.float(),
        }
        if bool((topk_idx < 0).any()):
            # HybridEP's index API scatters topk_idx into a [tokens, experts] map, where -1 is
            # out of range; a slot that routes nowhere is a False in the routing map, which
            # its dispatch takes directly (the form Megatron passes).
            routing_map, probs = _topk_to_routing_map(topk_idx, topk_weights, self.shape.experts)
            route = {"routing_map": routing_map, "probs": probs}
        recv_x, recv_probs, _, handle = self.buffer.dispatch(
            hidden=x, num_of_experts=self.shape.experts, **route
        )
        # handle = (sparse_to_dense_map, rdma_to_attn_map, attn_to_rdma_map,
        #           num_dispatched_tokens_tensor, local_expert_routing_map, tokens, config)
        rows = int(handle[3].reshape(-1)[0].item())
        routing = handle[4][:rows].bool()  # [rows, local experts]
        # Probs come back for the experts of the whole NVLink domain; this rank's slice
        # starts at local_rank * local_experts.
        start = self.buffer.local_rank * self.local
        local_probs = recv_probs[:rows, start : start + self.local].float()
        recv_idx, recv_w = _routing_map_to_topk(routing, local_probs, self.shape.topk)
        counts = routing.sum(dim=0).tolist()
        return Dispatched(
            recv_x=recv_x[:rows],
            recv_topk_idx=recv_idx,
            recv_topk_weights=recv_w,
            num_recv_per_expert=[int(c) for c in counts],
            handle=HybridHandle(
                handle,
                rows,
                recv_x.shape[0],
                topk_idx=topk_idx.to(torch.int64),
                recv_topk_idx=recv_idx,
                probs_width=int(recv_probs.shape[1]),
            ),
        )

    def combine(self, y: torch.Tensor, handle: RowsHandle) -> torch.Tensor:
        combined, _ = self.buffer.combine(
            hidden=pad_rows(y, handle.padded_rows), probs=None, handle=handle.raw
        )
        if not self._published:  # preprocessing, dispatch and combine kernels exist now
            self.jit.publish()
            self._published = True
        return combined

    def dispatch_backward_with_weights(
        self, grad_recv_x: torch.Tensor, grad_recv_topk_weights: torch.Tensor, handle: HybridHandle
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # HybridEP combines probs in the layout dispatch returned them ([rows, experts of the
        # NVLink domain], this rank's slice filled) and gives them back per token and global
        # expert (its tests/test_hybrid_ep.py at e0a5b1d9); the slots are read back from there.
        rows, local = handle.rows, self.local
        recv_idx = handle.recv_topk_idx
        probs = torch.zeros(
            (handle.padded_rows, handle.probs_width),
            dtype=torch.float32,
            device=grad_recv_x.device,
        )
        start = self.buffer.local_rank * local
        valid = recv_idx >= 0
        cols = torch.where(valid, recv_idx + start, torch.zeros_like(recv_idx))
        grads = torch.where(valid, grad_recv_topk_weights.float(), torch.zeros_like(cols).float())
        probs[:rows].scatter_add_(1, cols, grads)
        combined, combined_probs = self.buffer.combine(
            hidden=pad_rows(grad_recv_x, handle.padded_rows), probs=probs, handle=handle.raw
        )
        topk_idx = handle.topk_idx
        grad_w = combined_probs.float().gather(1, topk_idx.clamp(min=0))
        return combined, torch.where(topk_idx >= 0, grad_w, torch.zeros_like(grad_w))

    def dispatch_cached(self, x: torch.Tensor, handle: RowsHandle) -> torch.Tensor:
        recv_x, _, _, _ = self.buffer.dispatch(
            hidden=x, num_of_experts=self.shape.experts, handle=handle.raw
        )
        return recv_x[: handle.rows]


def _topk_to_routing_map(
    topk_idx: torch.Tensor, topk_weights: torch.Tensor, experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing (``-1``: no expert) as HybridEP's ``[tokens, experts]`` bool routing map
    and float32 probs, the tensors its ``indices_to_map`` builds from valid indices."""
    idx = topk_idx.to(torch.int64)
    valid = idx >= 0
    # Slots with idx -1 go to a spare last column, dropped at the end.
    slot = torch.where(valid, idx, torch.full_like(idx, experts))
    rows = idx.shape[0]
    routing = torch.zeros((rows, experts + 1), dtype=torch.bool, device=idx.device)
    routing.scatter_(1, slot, True)
    probs = torch.zeros((rows, experts + 1), dtype=torch.float32, device=idx.device)
    weights = torch.where(valid, topk_weights.float(), torch.zeros_like(topk_weights.float()))
    probs.scatter_(1, slot, weights)
    return routing[:, :experts].contiguous(), probs[:, :experts].contiguous()


def _routing_map_to_topk(
    routing: torch.Tensor, probs: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``[rows, local]`` bool map as ``[rows, topk]`` local indices (-1 padded) and weights."""
    rows, local = routing.shape
    order = torch.arange(local, device=routing.device).expand(rows, local)
    keyed = torch.where(routing, order, torch.full_like(order, local))
    keyed = keyed.sort(dim=1).values[:, : min(topk, local)]
    idx = torch.where(keyed < local, keyed, torch.full_like(keyed, -1))
    if idx.shape[1] < topk:
        pad = torch.full((rows, topk - idx.shape[1]), -1, dtype=idx.dtype, device=idx.device)
        idx = torch.cat([idx, pad], dim=1)
    weights = torch.where(
        idx >= 0, probs.gather(1, idx.clamp(min=0)), torch.zeros_like(probs[:, :1])
    )
    return idx, weights
