"""How an MoE layer's tokens reach the experts and come back: through the backend under test,
or through the all-gather fallback that frameworks use without one.

Why this module exists: the model is the same in both cases; only this exchange differs, so the
two trainings can be held against each other. The backend runs as training frameworks call it:
dispatch and combine inside ``autograd.Function``s, the router's top-k weights sent with the
tokens and their gradient carried back by dispatch's backward, each layer's handle alive until
its backward, and under activation checkpointing the layer's dispatch called again in the
recompute. The recompute is held against its forward here (:class:`RecomputeLedger`): the
backward pairs the forward's handle with what the recompute returned, so anything but the same
rows in the same order is wrong, and the check says which it is instead of a raw
``CheckpointError`` or silently wrong gradients.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist

from ep_image.probes.check_ep.adapters.base import EPBackend
from ep_image.probes.check_train.model import Experts


class RecomputeMismatch(Exception):
    """A layer's recompute got other rows from dispatch than its forward did; raised on every
    rank at once (the ranks agree on it first), so no rank is left in a collective."""


@dataclasses.dataclass
class Fingerprint:
    """What a dispatch returned, in a few numbers: rows, counts per expert, and two hashes of
    every row's bits (rows, routing and weights), one that depends on the rows' order and one
    that does not. Keeps no copy of the rows (the recompute exists to save that memory), and
    its hashes stay on the device until a recompute compares them (no host sync in the
    forward)."""

    rows: int
    per_expert: list[int]
    hashes: torch.Tensor  # [ordered, unordered], int64

    @classmethod
    def of(
        cls, recv_x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, per_expert: Any
    ) -> Fingerprint:
        bits = _row_bits(recv_x, idx, w)
        row_hash = (bits * _mixers(bits.shape[1], bits.device, 1)).sum(dim=1)
        position = _mixers(bits.shape[0], bits.device, 2)
        hashes = torch.stack([(row_hash * position).sum(), row_hash.sum()])
        return cls(int(recv_x.shape[0]), [int(c) for c in per_expert], hashes)


def _row_bits(recv_x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Each row's bits as int64 columns: the payload, its routing and its weights."""
    parts = []
    for t in (recv_x, idx, w):
        columns = math.prod(t.shape[1:])  # reshape(rows, -1) fails on 0 rows
        flat = t.detach().reshape(t.shape[0], columns).contiguous()
        view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
        parts.append(flat.view(view).to(torch.int64))
    return torch.cat(parts, dim=1)


def _mixers(n: int, device: torch.device, salt: int) -> torch.Tensor:
    """``n`` fixed odd 63-bit multipliers (a hash's weights; int64 arithmetic wraps)."""
    gen = torch.Generator()
    gen.manual_seed(0x5EED0000 + salt)
    return (torch.randint(0, 1 << 62, (n,), generator=gen, dtype=torch.int64) * 2 + 1).to(device)


@dataclasses.dataclass
class Recorded:
    """A layer's forward dispatch in the current pass: its fingerprint, its handle, and (for
    ``--recompute cached``) the routing it delivered."""

    fingerprint: Fingerprint
    handle: Any
    recv_idx: torch.Tensor
    recv_weights: torch.Tensor


@dataclasses.dataclass
class RecomputeLedger:
    """Each layer's first dispatch of a checkpointed pass, to hold its recompute against. A
    pass is one forward and backward; a second dispatch of a layer in the same pass is its
    recompute. A pass without checkpointing records nothing."""

    ctrl_group: Any  # gloo: the ranks agree on a mismatch before any rank raises
    mode: str = "dispatch"  # dispatch | cached: what the recompute asks of the backend
    step: int = 0
    checking: bool = False  # this pass is checkpointed: record and compare
    records: dict[int, Recorded] = dataclasses.field(default_factory=dict)
    #: What every recompute found, in order: {"step", "layer", "rows", "how"}.
    checks: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def begin(self, step: int, checking: bool) -> None:
        self.step = step
        self.checking = checking
        self.records.clear()

    def recompare(self, layer: int, found: Fingerprint) -> None:
        """Hold a recompute's dispatch against its forward's; on a mismatch anywhere, raise
        :class:`RecomputeMismatch` on every rank."""
        was = self.records[layer].fingerprint
        ordered, unordered = (found.hashes == was.hashes).tolist()
        if found.rows != was.rows:
            how = f"{found.rows} rows where its forward got {was.rows}"
        elif found.per_expert != was.per_expert:
            how = "other counts per expert than its forward"
        elif not unordered:
            how = f"{found.rows} rows, as its forward, but other rows"
        elif not ordered:
            how = "the rows of its forward in another order"
        else:
            how = ""
        self.checks.append(
            {"step": self.step, "layer": layer, "rows": [was.rows, found.rows], "how": how}
        )
        bad = torch.tensor([1 if how else 0], dtype=torch.int64)
        flags = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
        dist.all_gather(flags, bad, group=self.ctrl_group)
        ranks = [r for r, f in enumerate(flags) if int(f.item())]
        if ranks:
            raise RecomputeMismatch(
                f"step {self.step}, layer {layer}: the recompute's dispatch returned "
                + (how or "what its forward did here, but not on other ranks")
                + f" (ranks {ranks})"
            )


class BackendExchange:
    """The backend's dispatch and combine around this rank's experts, as frameworks call them."""

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

    def __call__(
        self, tokens: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, layer: int
    ) -> torch.Tensor:
        recv_x, recv_w, recv_idx, handle = _Dispatch.apply(tokens, weights, idx, self, layer)
        rows = self.experts_of(layer)(recv_x, recv_idx, recv_w)
        out = _Combine.apply(rows, self, handle, layer)
        self.flag("forward", layer, out)
        return out

    def flag(self, where: str, layer: int, t: torch.Tensor) -> None:
        ok = torch.isfinite(t).all()
        key = (where, layer)
        self.finite[key] = self.finite[key] & ok if key in self.finite else ok

    def dispatch(
        self, tokens: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        """The forward's dispatch, or the recompute's held against it."""
        ledger = self.ledger
        if not ledger.checking:
            d = self.backend.dispatch(tokens, idx, weights.detach())
            return d.recv_x, d.recv_topk_weights.float(), d.recv_topk_idx, d.handle
        recorded = ledger.records.get(layer)
        if recorded is not None and ledger.mode == "cached":
            recv_x = self.backend.dispatch_cached(tokens, recorded.handle)
            found = Fingerprint.of(
                recv_x, recorded.recv_idx, recorded.recv_weights, recorded.fingerprint.per_expert
            )
            ledger.recompare(layer, found)
            return recv_x, recorded.recv_weights, recorded.recv_idx, recorded.handle
        d = self.backend.dispatch(tokens, idx, weights.detach())
        recv_w = d.recv_topk_weights.float()
        found = Fingerprint.of(d.recv_x, d.recv_topk_idx, recv_w, d.num_recv_per_expert)
        if recorded is None:
            ledger.records[layer] = Recorded(found, d.handle, d.recv_topk_idx, recv_w)
        else:
            ledger.recompare(layer, found)
        return d.recv_x, recv_w, d.recv_topk_idx, d.handle


class _Dispatch(torch.autograd.Function):
    """dispatch: rows and top-k weights to the experts' ranks; backward: both gradients back
    through the backend's combine (``dispatch_backward_with_weights``)."""

    @staticmethod
    def forward(ctx, tokens, weights, idx, exchange, layer):  # type: ignore[override]
        recv_x, recv_w, recv_idx, handle = exchange.dispatch(tokens, weights, idx, layer)
        ctx.exchange, ctx.handle, ctx.layer = exchange, handle, layer
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_w, recv_idx, handle

    @staticmethod
    def backward(ctx, grad_x, grad_w, _grad_idx, _grad_handle):  # type: ignore[override]
        exchange = ctx.exchange
        if grad_w is None:
            grad_w = torch.zeros_like(grad_x[:, :1]).float()
        grad_tokens, grad_weights = exchange.backend.dispatch_backward_with_weights(
            grad_x.contiguous(), grad_w.float().contiguous(), ctx.handle
        )
        exchange.flag("backward", ctx.layer, grad_tokens)
        return grad_tokens, grad_weights, None, None, None


class _Combine(torch.autograd.Function):
    """combine: the experts' rows summed back onto their tokens; backward: the tokens'
    gradients copied back to every row (``combine_backward``)."""

    @staticmethod
    def forward(ctx, rows, exchange, handle, layer):  # type: ignore[override]
        ctx.exchange, ctx.handle = exchange, handle
        return exchange.backend.combine(rows, handle)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return (
            ctx.exchange.backend.combine_backward(grad.contiguous(), ctx.handle),
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
