"""How an MoE layer's tokens reach the experts and come back: through the backend under test,
or through the all-gather fallback that frameworks use without one.

Why this module exists: the model is the same in both cases; only this exchange differs, so the
two trainings can be held against each other. The backend runs as training frameworks call it:
dispatch and combine inside ``autograd.Function``s, the router's top-k weights sent with the
tokens and their gradient carried back by dispatch's backward, each layer's handle alive until
its backward, and under activation checkpointing the layer's dispatch called again in the
recompute, whose handle the backward then uses (as a reentrant recompute does). The recompute
is held against its forward (``recompute``), which names what it returned instead of a raw
``CheckpointError`` or silently wrong gradients.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ep_image.probes._adapters.base import EPBackend
from ep_image.probes.check_train.model import Experts
from ep_image.probes.check_train.recompute import Fingerprint, RecomputeLedger


class BackendExchange:
    """The backend's dispatch and combine around this rank's experts, as frameworks call them.

    Each layer's handle lives in a slot (:attr:`handles`) that every dispatch of the layer
    refreshes, and both backward ops read it. Under torch's non-reentrant checkpoint the
    backward keeps the forward's autograd nodes but takes the tensors they saved (the experts'
    rows) from the recompute; reading the handle from the slot sends the recompute's rows back
    through the recompute's handle, as a reentrant recompute (Megatron's) does, so a backend
    may return the same rows in another order each call (its adapters' contract)."""

    def __init__(
        self, backend: EPBackend, experts_of: Any, rank: int, local: int, ledger: RecomputeLedger
    ) -> None:
        self.backend = backend
        self.experts_of = experts_of  # layer index -> Experts
        self.ledger = ledger
        self.rank = rank
        self.local = local
        #: Per layer and pass: whether every MoE output (forward) and every gradient into the
        #: layer (backward) was finite, as device flags read once per step.
        self.finite: dict[tuple[str, int], torch.Tensor] = {}
        #: Per layer: the handle of its latest dispatch in this pass (the recompute's, once it
        #: ran), until the layer's backward has used it.
        self.handles: dict[int, Any] = {}
        #: Per layer, for ``--recompute cached``: the forward's layout (handle, routing and
        #: weights received, counts per expert) that the recompute dispatches along.
        self.layouts: dict[int, tuple[Any, torch.Tensor, torch.Tensor, list[int]]] = {}
        #: Per layer: its dispatches in this pass (a second is its recompute).
        self.calls: dict[int, int] = {}

    def begin(self, step: int, checking: bool) -> None:
        """A new pass (one forward and backward); ``checking``: hold its recomputes against
        their forwards."""
        self.calls.clear()
        self.handles.clear()
        self.layouts.clear()
        self.ledger.begin(step, checking)

    def recomputing(self, layer: int) -> bool:
        return self.calls.get(layer, 0) > 1

    def __call__(
        self, tokens: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, layer: int
    ) -> torch.Tensor:
        recv_x, recv_w, recv_idx, handle = _Dispatch.apply(tokens, weights, idx, self, layer)
        rows = self.experts_of(layer)(recv_x, recv_idx, recv_w)
        out = _Combine.apply(rows, self, handle, layer, tokens.shape[0])
        if not self.recomputing(layer):
            self.flag("forward", layer, out)
        return out

    def flag(self, where: str, layer: int, t: torch.Tensor) -> None:
        ok = torch.isfinite(t.detach()).all()  # detached: autograd saves nothing for it
        key = (where, layer)
        self.finite[key] = self.finite[key] & ok if key in self.finite else ok

    def dispatch(
        self, tokens: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        """The forward's dispatch, or the recompute's (held against the forward's when the
        pass is checked); either one's handle goes into the layer's slot."""
        self.calls[layer] = self.calls.get(layer, 0) + 1
        ledger = self.ledger
        if self.recomputing(layer) and ledger.mode == "cached":
            handle, recv_idx, recv_w, per_expert = self.layouts[layer]
            recv_x = self.backend.dispatch_cached(tokens, handle)
            if ledger.checking:
                ledger.recompare(layer, Fingerprint.of(recv_x, recv_idx, recv_w, per_expert))
            return recv_x, recv_w, recv_idx, handle
        d = self.backend.dispatch(tokens, idx, weights.detach())
        recv_w = d.recv_topk_weights.float()
        self.handles[layer] = d.handle
        if ledger.mode == "cached":
            self.layouts[layer] = (d.handle, d.recv_topk_idx, recv_w, d.num_recv_per_expert)
        if ledger.checking:
            found = Fingerprint.of(d.recv_x, d.recv_topk_idx, recv_w, d.num_recv_per_expert)
            if self.recomputing(layer):
                ledger.recompare(layer, found)
            else:
                ledger.record(layer, found)
        return d.recv_x, recv_w, d.recv_topk_idx, d.handle

    def handle_of(self, layer: int, last: bool = False) -> Any:
        """The handle of the layer's latest dispatch; ``last``: its backward is done with it."""
        if last:
            self.layouts.pop(layer, None)
            return self.handles.pop(layer)
        return self.handles[layer]


class _Dispatch(torch.autograd.Function):
    """dispatch: rows and top-k weights to the experts' ranks; backward: both gradients back
    through the backend's combine (``dispatch_backward_with_weights``), along the handle of the
    layer's latest dispatch (the recompute's under checkpointing)."""

    @staticmethod
    def forward(ctx, tokens, weights, idx, exchange, layer):  # type: ignore[override]
        recv_x, recv_w, recv_idx, handle = exchange.dispatch(tokens, weights, idx, layer)
        ctx.exchange, ctx.layer = exchange, layer
        ctx.weights_shape = tuple(recv_w.shape)
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_w, recv_idx, handle

    @staticmethod
    def backward(ctx, grad_x, grad_w, _grad_idx, _grad_handle):  # type: ignore[override]
        exchange = ctx.exchange
        if grad_w is None:  # the weights reached no expert here: nothing flows back for them
            grad_w = torch.zeros(ctx.weights_shape, dtype=torch.float32, device=grad_x.device)
        grad_tokens, grad_weights = exchange.backend.dispatch_backward_with_weights(
            grad_x.contiguous(), grad_w.float().contiguous(), exchange.handle_of(ctx.layer, True)
        )
        exchange.flag("backward", ctx.layer, grad_tokens)
        return grad_tokens, grad_weights, None, None, None


class _Combine(torch.autograd.Function):
    """combine: the experts' rows summed back onto their tokens; backward: the tokens'
    gradients copied back to every row (``combine_backward``) along the handle of the layer's
    latest dispatch.

    It saves an empty marker so that, under checkpointing, its backward unpacks a recomputed
    tensor first: the layer is then recomputed (and its slot holds the recompute's handle)
    before the handle is read. In the recompute it combines nothing: checkpointing keeps the
    forward's output, and the backward needs none of the recompute's."""

    @staticmethod
    def forward(ctx, rows, exchange, handle, layer, tokens):  # type: ignore[override]
        ctx.save_for_backward(rows.new_empty(0))
        ctx.exchange, ctx.layer = exchange, layer
        if exchange.recomputing(layer):
            return rows.new_zeros((tokens, rows.shape[1]))
        return exchange.backend.combine(rows, handle)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.saved_tensors  # noqa: B018 - unpacking it runs the layer's recompute first
        handle = ctx.exchange.handle_of(ctx.layer)
        return (
            ctx.exchange.backend.combine_backward(grad.contiguous(), handle),
            None,
            None,
            None,
            None,
        )


class _AllGather(torch.autograd.Function):
    """Every rank's equal-sized tensors in rank order, several at once; backward: each gradient
    summed over ranks (an all-reduce, which gloo has where it lacks a reduce-scatter), this
    rank's part kept. One node for all of them, so their collectives run in one order on every
    rank, whatever order autograd would give separate nodes."""

    @staticmethod
    def forward(ctx, group, *tensors):  # type: ignore[override]
        ctx.group, ctx.rank = group, dist.get_rank(group)
        ctx.rows = [t.shape[0] for t in tensors]
        world = dist.get_world_size(group)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        outs = []
        for t in tensors:
            out = t.new_empty((world * t.shape[0], *t.shape[1:]))
            gather(out, t.contiguous(), group=group)
            outs.append(out)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        out = []
        for grad, rows in zip(grads, ctx.rows, strict=True):
            if grad is None:  # no gradient here: still the same collective as every rank's
                out.append(None)
                dist.all_reduce(torch.zeros(1), group=ctx.group)
                continue
            total = grad.float().contiguous()
            dist.all_reduce(total, group=ctx.group)
            start = ctx.rank * rows
            out.append(total[start : start + rows].to(grad.dtype))
        return (None, *out)


class _AllReduce(torch.autograd.Function):
    """The sum over ranks, in fp32 and rounded once; backward: the same sum of gradients."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        total = x.float().contiguous()
        dist.all_reduce(total, group=group)
        return total.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        total = grad.float().contiguous()
        dist.all_reduce(total, group=ctx.group)
        return total.to(grad.dtype), None


class FallbackExchange:
    """The all-gather fallback (frameworks' ``dispatcher: torch``): every token, its routing and
    weights gathered to every rank, this rank's experts run on the tokens routed to them, and
    the outputs summed over ranks, each rank keeping its own tokens'."""

    def __init__(self, experts_of: Any, group: Any, rank: int, local: int) -> None:
        self.experts_of = experts_of
        self.group = group
        self.rank = rank
        self.local = local

    def __call__(
        self, tokens: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, layer: int
    ) -> torch.Tensor:
        rows, all_weights = _AllGather.apply(self.group, tokens, weights.float())
        with torch.no_grad():
            (all_idx,) = _AllGather.apply(self.group, idx)
        lo = self.rank * self.local
        mine = (all_idx >= lo) & (all_idx < lo + self.local)
        local_idx = torch.where(mine, all_idx - lo, torch.full_like(all_idx, -1))
        experts: Experts = self.experts_of(layer)
        out = _AllReduce.apply(experts(rows, local_idx, all_weights), self.group)
        start = self.rank * tokens.shape[0]
        return out[start : start + tokens.shape[0]]
