"""A real adapter with one fault, for ``check-ep`` / ``check-train --backend-class``.

Why: the verdicts that let a real backend pass (preconditions, a new row order on recompute)
must not let a broken one through; each class here drives the real buffers of the backend that
``EP_FAULT_BASE`` names (default deepep_v2) and breaks exactly one thing in what comes back.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ep_image.probes._adapters.base import Dispatched
from ep_image.probes._adapters.plugins import BUILTIN

BASE_NAME = os.environ.get("EP_FAULT_BASE", "deepep_v2")
Base = BUILTIN[BASE_NAME]


class LosesOneToken(Base):
    """Dispatch loses the last row it received (a token that never reaches its experts); the
    row the combine needs back is sent as zeros, so the token misses that contribution."""

    name = f"{BASE_NAME}_loses_one_token"

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> Dispatched:
        d = super().dispatch(x, topk_idx, topk_weights)
        if d.recv_x.shape[0] == 0:
            return d
        lost = d.recv_topk_idx[-1].tolist()
        counts = [int(c) for c in d.num_recv_per_expert]
        for e in lost:
            if e >= 0:
                counts[e] -= 1
        return Dispatched(
            d.recv_x[:-1],
            d.recv_topk_idx[:-1],
            d.recv_topk_weights[:-1],
            counts,
            (d.handle, d.recv_x.shape[0]),
        )

    def _full(self, y: torch.Tensor, handle: Any) -> tuple[torch.Tensor, Any]:
        inner, rows = handle
        if y.shape[0] < rows:
            pad = y.new_zeros((rows - y.shape[0], *y.shape[1:]))
            y = torch.cat([y, pad])
        return y, inner

    def combine(self, y: torch.Tensor, handle: Any) -> torch.Tensor:
        return super().combine(*self._full(y, handle))

    def combine_backward(self, grad_out: torch.Tensor, handle: Any) -> torch.Tensor:
        inner, rows = handle
        return super().combine_backward(grad_out, inner)[: rows - 1]

    def dispatch_cached(self, x: torch.Tensor, handle: Any) -> torch.Tensor:
        inner, rows = handle
        return super().dispatch_cached(x, inner)[: rows - 1]

    def dispatch_backward(self, grad_recv_x: torch.Tensor, handle: Any) -> torch.Tensor:
        return super().dispatch_backward(*self._full(grad_recv_x, handle))

    def dispatch_backward_with_weights(
        self, grad_recv_x: torch.Tensor, grad_recv_w: torch.Tensor, handle: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, inner = self._full(grad_recv_x, handle)
        w, _ = self._full(grad_recv_w, handle)
        return super().dispatch_backward_with_weights(x, w, inner)


class WrongWeights(Base):
    """Dispatch delivers each received row's top-k weights in the wrong slots (rolled by one):
    the experts weight their outputs with another expert's probability."""

    name = f"{BASE_NAME}_wrong_weights"

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> Dispatched:
        d = super().dispatch(x, topk_idx, topk_weights)
        rolled = torch.roll(d.recv_topk_weights, shifts=1, dims=1)
        return Dispatched(d.recv_x, d.recv_topk_idx, rolled, d.num_recv_per_expert, d.handle)


class StaleHandleOnRecompute(Base):
    """A routing dispatched again (activation checkpointing's recompute) gets its new rows with
    the handle of its first dispatch: where the backend returns rows in another order on the
    second call, the backward then pairs one layout's rows with the other's handle."""

    name = f"{BASE_NAME}_stale_handle_on_recompute"

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> Dispatched:
        d = super().dispatch(x, topk_idx, topk_weights)
        seen: dict[tuple[Any, ...], Any] = self.__dict__.setdefault("_first_handles", {})
        key = (
            tuple(topk_idx.shape),
            int(topk_idx.sum()),
            int((topk_idx * topk_idx).sum()),
            float(x.float().sum()),
        )
        if key in seen:
            return Dispatched(
                d.recv_x, d.recv_topk_idx, d.recv_topk_weights, d.num_recv_per_expert, seen.pop(key)
            )
        seen[key] = d.handle
        return d
