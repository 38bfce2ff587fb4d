"""The reference backend: all-gather dispatch and all-reduce combine in plain torch.distributed.

Why this module exists: it is what MoE code falls back to without DeepEP, obviously correct and
runnable anywhere (gloo on CPUs, NCCL on GPUs), so every check of the probe runs in CI on a real
multi-process group; the tests' broken backends are this one with one fault each.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ep_image.probes._adapters.base import Dispatched, EPBackend, Shape


def all_gather_rows(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate the tensor ``t`` (same shape on every rank) from all ranks along dim 0."""
    world = dist.get_world_size(group)
    out = t.new_empty((world * t.shape[0], *t.shape[1:]))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, t.contiguous(), group=group)
    return out


@dataclasses.dataclass
class TorchHandle:
    """Where each received row came from, as rows of the padded all-gathered token list."""

    rows: torch.Tensor  # index into [world * max_tokens]
    max_tokens: int
    tokens: int  # this rank's token count


class TorchBackend(EPBackend):
    """All-gather dispatch and all-reduce combine: slow, obviously correct, runs anywhere.

    This is what MoE code falls back to without DeepEP (a token-count all_gather, padded
    all_gathers of tokens and routing, an all-reduce to combine). The probe uses it to
    exercise every check on a real multi-process group in CI.
    """

    name = "torch"
    requires_gpu = False
    dtypes = ("float32", "bfloat16", "float16")

    def create(self, group: dist.ProcessGroup, shape: Shape) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.shape = shape
        self.local = shape.local_experts(self.world)

    def _gather_padded(self, t: torch.Tensor, max_tokens: int) -> torch.Tensor:
        padded = t.new_zeros((max_tokens, *t.shape[1:]))
        padded[: t.shape[0]] = t
        return all_gather_rows(padded, self.group)

    def _max_tokens(self, tokens: int, device: torch.device) -> int:
        count = torch.tensor([tokens], dtype=torch.int64, device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.group)
        return max(int(count.item()), 1)  # a padding row when no rank holds a token

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> Dispatched:
        tokens = x.shape[0]
        max_tokens = self._max_tokens(tokens, x.device)
        g_x = self._gather_padded(x, max_tokens)
        # Padding rows route nowhere (-1), so they are never received.
        idx = torch.full((max_tokens, topk_idx.shape[1]), -1, dtype=torch.int64, device=x.device)
        idx[:tokens] = topk_idx.to(torch.int64)
        g_idx = all_gather_rows(idx, self.group)
        g_w = self._gather_padded(topk_weights.float(), max_tokens)

        lo = self.rank * self.local
        mine = (g_idx >= lo) & (g_idx < lo + self.local)
        rows = mine.any(dim=1).nonzero().squeeze(1)
        recv_idx = torch.where(mine[rows], g_idx[rows] - lo, torch.full_like(g_idx[rows], -1))
        counts = torch.bincount(recv_idx[recv_idx >= 0], minlength=self.local)
        return Dispatched(
            recv_x=g_x[rows],
            recv_topk_idx=recv_idx,
            recv_topk_weights=g_w[rows],
            num_recv_per_expert=[int(c) for c in counts.tolist()],
            handle=TorchHandle(rows=rows, max_tokens=max_tokens, tokens=tokens),
        )

    def combine(self, y: torch.Tensor, handle: TorchHandle) -> torch.Tensor:
        full = torch.zeros(
            (self.world * handle.max_tokens, y.shape[1]), dtype=torch.float32, device=y.device
        )
        full.index_add_(0, handle.rows, y.float())
        dist.all_reduce(full, group=self.group)
        start = self.rank * handle.max_tokens
        return full[start : start + handle.tokens].to(y.dtype)

    def dispatch_cached(self, x: torch.Tensor, handle: TorchHandle) -> torch.Tensor:
        return self._gather_padded(x, handle.max_tokens)[handle.rows]

    def dispatch_backward_with_weights(
        self, grad_recv_x: torch.Tensor, grad_recv_topk_weights: torch.Tensor, handle: TorchHandle
    ) -> tuple[torch.Tensor, torch.Tensor]:
        grad_x = self.dispatch_backward(grad_recv_x, handle)
        slots = grad_recv_topk_weights.shape[1]
        full = torch.zeros(
            (self.world * handle.max_tokens, slots),
            dtype=torch.float32,
            device=grad_recv_topk_weights.device,
        )
        full.index_add_(0, handle.rows, grad_recv_topk_weights.float())
        dist.all_reduce(full, group=self.group)
        start = self.rank * handle.max_tokens
        return grad_x, full[start : start + handle.tokens]
