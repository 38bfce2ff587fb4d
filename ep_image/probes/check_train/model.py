"""The model check_train trains: a small MoE transformer on a learnable synthetic task.

Why this module exists: a backend proves itself in training only, where a router's top-k picks
the experts, experts run as grouped GEMMs between dispatch and combine, gradients flow back
through both (the router's included), two layers share one buffer and activation
checkpointing recomputes a layer. The model is the same whatever exchanges its tokens
(``exchange``): the backend's dispatch and combine, or the all-gather fallback, so the two
can be held against each other step by step. Attention and the dense linears run through
Transformer Engine (fused attention, ``te.Linear``) when TE is loaded, plain torch otherwise;
the weights are fp32 (the master copy AdamW updates) and every matrix product runs in the
compute dtype (bf16), the router's excepted (fp32, as frameworks keep it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ep_image.probes.check_train.routing import RoutingReplay
from ep_image.probes.check_train.types import FFN_FACTOR, VOCAB


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The model's sizes; ``tokens`` per rank and step, ``experts`` over all ranks."""

    tokens: int
    hidden: int
    experts: int
    topk: int
    layers: int
    seq: int
    heads: int
    vocab: int = VOCAB

    @property
    def batch(self) -> int:
        return self.tokens // self.seq

    @property
    def ffn(self) -> int:
        return FFN_FACTOR * self.hidden

    @classmethod
    def of(cls, sizes: dict[str, int]) -> ModelShape:
        keys = ("tokens", "hidden", "experts", "topk", "layers", "seq", "heads")
        return cls(**{k: sizes[k] for k in keys})


#: Exchange(tokens [T, H], topk_idx [T, K], topk_weights [T, K], layer) -> [T, H]: the MoE
#: layer's token exchange with the experts in between (``exchange.Exchange``).
MoEFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def _normal(gen: torch.Generator, *shape: int, std: float) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * std


class Experts(torch.nn.Module):
    """This rank's experts (a GELU MLP each), run as one grouped GEMM per layer of the MLP:
    the rows sorted by expert, one matrix product per expert's group.

    ``forward(rows, local_idx, weights)``: ``rows`` [R, H] in the compute dtype, ``local_idx``
    [R, K] this rank's expert of each slot (-1: not here), ``weights`` [R, K] fp32. Returns
    [R, H]: each row's experts' outputs times their weights, summed in fp32 and rounded once.
    Every write goes to its own (row, slot) place, so the result does not depend on the order
    the rows come in or on atomics.
    """

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(w1)  # [local, H, F]
        self.w2 = torch.nn.Parameter(w2)  # [local, F, H]

    def forward(
        self, rows: torch.Tensor, local_idx: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        count, slots = rows.shape[0], local_idx.shape[1]
        local = self.w1.shape[0]
        pair_row, pair_slot = (local_idx >= 0).nonzero(as_tuple=True)
        expert = local_idx[pair_row, pair_slot]
        order = torch.argsort(expert, stable=True)
        pair_row, pair_slot, expert = pair_row[order], pair_slot[order], expert[order]
        sizes = torch.bincount(expert, minlength=local).tolist()
        grouped = rows[pair_row]
        outputs = []
        # Every expert's GEMMs run, an expert without rows too: its output then still depends on
        # ``rows`` and its weights, so every rank's backward takes the same path through the
        # exchange's collectives (a rank whose experts got no row would otherwise skip one).
        for e, part in enumerate(torch.split(grouped, sizes)):
            inner = F.gelu(part @ self.w1[e].to(rows.dtype))
            outputs.append(inner @ self.w2[e].to(rows.dtype))
        out = torch.cat(outputs)
        weighted = out.float() * weights[pair_row, pair_slot].float()[:, None]
        per_slot = torch.zeros(
            (count, slots, rows.shape[1]), dtype=torch.float32, device=rows.device
        )
        per_slot = per_slot.index_put((pair_row, pair_slot), weighted)
        return per_slot.sum(dim=1).to(rows.dtype)


class Linear(torch.nn.Module):
    """A linear layer of fp32 weights computed in the compute dtype: ``te.Linear`` under
    autocast when TE is used, else ``F.linear`` on the weights cast at each call."""

    def __init__(self, weight: torch.Tensor, te: Any) -> None:
        super().__init__()
        out_features, in_features = weight.shape
        self.te_linear = None
        if te is not None:
            self.te_linear = te.Linear(
                in_features,
                out_features,
                bias=False,
                params_dtype=torch.float32,
                device=weight.device,
            )
            with torch.no_grad():
                self.te_linear.weight.copy_(weight)
        else:
            self.weight = torch.nn.Parameter(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.te_linear is not None:
            with torch.autocast("cuda", dtype=x.dtype):
                return self.te_linear(x)
        return F.linear(x, self.weight.to(x.dtype))


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm computed in fp32, returned in ``x``'s dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * weight).to(x.dtype)


class Block(torch.nn.Module):
    """Pre-norm attention, then a pre-norm MoE layer, each around the residual."""

    def __init__(self, params: dict[str, torch.Tensor], shape: ModelShape, te: Any) -> None:
        super().__init__()
        self.shape = shape
        self.attn_norm = torch.nn.Parameter(params["attn_norm"])
        self.qkv = Linear(params["qkv"], te)
        self.proj = Linear(params["proj"], te)
        self.moe_norm = torch.nn.Parameter(params["moe_norm"])
        self.router = torch.nn.Parameter(params["router"])
        self.experts = Experts(params["w1"], params["w2"])
        self.attention = (
            te.DotProductAttention(
                num_attention_heads=shape.heads,
                kv_channels=shape.hidden // shape.heads,
                attn_mask_type="causal",
                qkv_format="bshd",
                attention_dropout=0.0,
            )
            if te is not None
            else None
        )

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        heads = self.shape.heads
        q, k, v = self.qkv(rms_norm(x, self.attn_norm)).view(b, s, 3, heads, h // heads).unbind(2)
        if self.attention is not None:
            out = self.attention(q.contiguous(), k.contiguous(), v.contiguous())
        else:
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).transpose(1, 2)
        return self.proj(out.reshape(b, s, h))

    def route(
        self, tokens: torch.Tensor, replay: RoutingReplay, index: int
    ) -> tuple[torch.Tensor, ...]:
        """Top-k experts of each token and their weights (softmax over the top-k, fp32); in a
        recompute, the forward's experts (``routing``)."""
        logits = F.linear(tokens.float(), self.router)
        return replay.route(index, logits, self.shape.topk)

    def forward(
        self, x: torch.Tensor, moe: MoEFn, index: int, replay: RoutingReplay
    ) -> torch.Tensor:
        x = x + self.attend(x)
        b, s, h = x.shape
        tokens = rms_norm(x, self.moe_norm).reshape(b * s, h)
        idx, weights = self.route(tokens, replay, index)
        return x + moe(tokens, idx, weights, index).view(b, s, h)


class MoETransformer(torch.nn.Module):
    """Embedding, ``layers`` blocks, a final norm and the output head. Built from ``seed`` alone
    (the same weights for every exchange, any world size): every rank holds the dense weights
    whole and its ``experts / world`` experts' slice of the global expert weights."""

    def __init__(
        self,
        shape: ModelShape,
        seed: int,
        rank: int,
        world: int,
        device: torch.device,
        te: Any = None,
    ) -> None:
        super().__init__()
        self.shape = shape
        gen = torch.Generator()
        gen.manual_seed(seed)
        h, f, v = shape.hidden, shape.ffn, shape.vocab
        local = shape.experts // world
        lo = rank * local

        def tensor(t: torch.Tensor) -> torch.Tensor:
            return t.to(device)

        self.embed = torch.nn.Parameter(tensor(_normal(gen, v, h, std=1.0)))
        blocks = []
        for _ in range(shape.layers):
            params = {
                "attn_norm": torch.ones(h),
                "qkv": _normal(gen, 3 * h, h, std=h**-0.5),
                "proj": _normal(gen, h, h, std=h**-0.5),
                "moe_norm": torch.ones(h),
                "router": _normal(gen, shape.experts, h, std=h**-0.5),
                "w1": _normal(gen, shape.experts, h, f, std=h**-0.5)[lo : lo + local],
                "w2": _normal(gen, shape.experts, f, h, std=f**-0.5)[lo : lo + local],
            }
            blocks.append(Block({k: tensor(p.contiguous()) for k, p in params.items()}, shape, te))
        self.blocks = torch.nn.ModuleList(blocks)
        self.final_norm = torch.nn.Parameter(tensor(torch.ones(h)))
        self.head = torch.nn.Parameter(tensor(_normal(gen, v, h, std=h**-0.5)))
        self.routing = RoutingReplay()

    def expert_parameters(self) -> list[torch.nn.Parameter]:
        """This rank's own weights (its experts): every other weight is every rank's."""
        return [p for b in self.blocks for p in b.experts.parameters()]

    def forward(
        self, tokens: torch.Tensor, moe: MoEFn, dtype: torch.dtype, checkpointed: bool
    ) -> torch.Tensor:
        """Logits (fp32) of ``tokens`` [batch, seq]; ``checkpointed``: each block under
        non-reentrant activation checkpointing, recomputed in the backward."""
        x = self.embed[tokens].to(dtype)
        self.routing.begin()
        for index, block in enumerate(self.blocks):
            if checkpointed:
                x = checkpoint(block, x, moe, index, self.routing, use_reentrant=False)
            else:
                x = block(x, moe, index, self.routing)
        return F.linear(rms_norm(x, self.final_norm), self.head.to(dtype)).float()


def batch_of(shape: ModelShape, seed: int, step: int, rank: int) -> tuple[Any, Any]:
    """The synthetic task: sequences in which each token is a fixed random permutation of the
    one before it (the permutation drawn from ``seed``), from random starts. Learnable within
    a few steps (the loss falls from about ln(vocab) towards 0), the same for every exchange,
    different on every rank and step."""
    perm = torch.randperm(shape.vocab, generator=torch.Generator().manual_seed(seed))
    gen = torch.Generator()
    gen.manual_seed((seed * 1_000_003 + step * 1009 + rank) % (1 << 62))
    seq = torch.empty((shape.batch, shape.seq + 1), dtype=torch.int64)
    seq[:, 0] = torch.randint(0, shape.vocab, (shape.batch,), generator=gen)
    for t in range(1, shape.seq + 1):
        seq[:, t] = perm[seq[:, t - 1]]
    return seq[:, :-1], seq[:, 1:]
