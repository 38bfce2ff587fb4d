"""The adapter of DeepEP v1's ``deep_ep.Buffer``: normal kernels, intranode and internode.

Why this module exists: v1 sizes its NVLink (and, across nodes, RDMA) buffer from hints per
config and takes the dispatch layout it computes itself; this adapter does both as
Megatron-style dispatchers do, behind :class:`EPBackend`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ep_image.probes._adapters.base import Dispatched, EPBackend, Shape
from ep_image.probes._adapters.deep_ep_common import import_deep_ep, module_facts


class DeepEPv1Backend(EPBackend):
    """DeepEP v1 ``deep_ep.Buffer``, normal kernels: intranode (NVLink) on one node, internode
    (NVLink + RDMA through NVSHMEM) when the ranks span nodes.

    The intranode kernels exist for 2, 4 and 8 ranks only; across nodes DeepEP needs 8 ranks
    per node (one NVLink domain of 8 GPUs) and an RDMA buffer, which ``Buffer.dispatch`` then
    uses on its own (``get_num_rdma_ranks() > 1``).
    """

    name = ""  # the backend's, given by adapter_for
    api = "Buffer"
    world_sizes = (2, 4, 8)
    world_size_note = (
        "DeepEP v1 intranode kernels support only 2, 4 or 8 ranks on one NVLink node; "
        "launch with torchrun --nproc-per-node 2, 4 or 8"
    )
    #: Ranks per node DeepEP's internode kernels are built for (NUM_MAX_NVL_PEERS).
    ranks_per_node_internode = 8

    def unsupported(self, world: int, local_world: int) -> str | None:
        if world <= local_world:
            return super().unsupported(world, local_world)
        if local_world != self.ranks_per_node_internode:
            return (
                "DeepEP v1 internode kernels need 8 ranks per node (one per GPU of an 8-GPU "
                f"NVLink node), not {local_world}: launch torchrun --nproc-per-node 8 on every node"
            )
        return None

    def load(self) -> dict[str, Any]:
        self.deep_ep = import_deep_ep()
        self.Buffer = self.deep_ep.Buffer
        self.topk_idx_t = getattr(self.deep_ep, "topk_idx_t", torch.int64)
        facts = module_facts(self.deep_ep)
        try:
            facts["sm90_compiled"] = bool(self.Buffer.is_sm90_compiled())
        except Exception:
            facts["sm90_compiled"] = None
        return facts

    def create(self, group: dist.ProcessGroup, shape: Shape) -> None:
        world = group.size()
        self.shape = shape
        hidden_bytes = shape.hidden * max(torch.tensor([], dtype=shape.dtype).element_size(), 2)
        # The NVLink buffer must hold a dispatch and a combine of this hidden size (the
        # sizing Megatron-style DeepEP dispatchers use).
        num_nvl_bytes = num_rdma_bytes = 0
        internode = world > self.ranks_per_node_internode
        for config in (
            self.Buffer.get_dispatch_config(world),
            self.Buffer.get_combine_config(world),
        ):
            num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, world), num_nvl_bytes)
            if internode:
                hint = config.get_rdma_buffer_size_hint(hidden_bytes, world)
                num_rdma_bytes = max(hint, num_rdma_bytes)
        self.buffer = self.Buffer(group, num_nvl_bytes, num_rdma_bytes, explicitly_destroy=True)
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> Dispatched:
        topk_idx = topk_idx.to(self.topk_idx_t)
        topk_weights = topk_weights.float()
        per_rank, per_rdma_rank, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(
            topk_idx, self.shape.experts
        )
        recv_x, recv_idx, recv_w, counts, handle, _ = self.buffer.dispatch(
            x,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
        )
        return Dispatched(recv_x, recv_idx, recv_w, [int(c) for c in counts], handle)

    def combine(self, y: torch.Tensor, handle: Any) -> torch.Tensor:
        combined, _, _ = self.buffer.combine(y, handle)
        return combined

    def dispatch_cached(self, x: torch.Tensor, handle: Any) -> torch.Tensor:
        recv_x, *_ = self.buffer.dispatch(x, handle=handle)
        return recv_x

    def dispatch_backward_with_weights(
        self, grad_recv_x: torch.Tensor, grad_recv_topk_weights: torch.Tensor, handle: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # One combine carries both, as Megatron's DeepEP dispatcher does in its backward.
        grad_x, grad_w, _ = self.buffer.combine(
            grad_recv_x, handle, topk_weights=grad_recv_topk_weights.float()
        )
        return grad_x, grad_w

    def destroy(self) -> None:
        buffer = getattr(self, "buffer", None)
        if buffer is not None:
            buffer.destroy()
            self.buffer = None
