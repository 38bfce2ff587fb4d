"""Inputs whose right answers are not exact, and what the sums over them must come to.

Why this module exists: every other input of the probe is chosen so that the right answer is
exact in bf16, which makes those checks bitwise, and also lets a backend whose arithmetic is
right only for such values pass (one that accumulates a token's contributions in bf16 instead of
fp32 does, since sums of +-2**j times quarters never round). As DeepEP's own tests do, this
module gives random payloads and router-like top-k weights, held against an fp32 reference with
DeepEP's bounds on ``calc_diff``; and stand-in expert outputs whose offsets cancel in each
token's sum, so that a running sum kept in the payload's dtype loses the payload under them
while one kept in fp32 and rounded once does not. See docs/probes.md, "Precision".
"""

from __future__ import annotations

import torch

from ep_image.probes._adapters.base import Shape
from ep_image.probes._ranks.layer import ID_BASE
from ep_image.probes.check_ep.reference.inputs import Inputs, id_mask, mix_seed, uniform_routing

#: DeepEP's bounds (tests/test_intranode.py): calc_diff of combined tokens against the fp32
#: reference, and of top-k weights.
COMBINE_BOUND = 5e-6
WEIGHTS_BOUND = 1e-9

#: Size of the cancelling offsets, in units of the payload's standard deviation (1): large
#: enough that a bf16 running sum rounds at 2**-3 or coarser, small enough for fp16.
OFFSET = 16.0

#: Mixed into --seed for the precision inputs (apart from the layer-shape and scenario ones).
SEED_SALT = 0x5EED


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepEP's ``calc_diff`` (tests/utils.py): ``1 - 2 sum(x y) / sum(x^2 + y^2)`` in float64;
    0 for equal tensors, inf when the shapes differ or a value is not finite."""
    if x.shape != y.shape:
        return float("inf")
    x64, y64 = x.double(), y.double()
    if x64.numel() and not bool(torch.isfinite(x64).all() and torch.isfinite(y64).all()):
        return float("inf")
    denominator = float((x64 * x64 + y64 * y64).sum())
    if denominator == 0:
        return 0.0
    return 1.0 - 2.0 * float((x64 * y64).sum()) / denominator


def make_random_inputs(shape: Shape, rank: int, seed: int) -> Inputs:
    """``rank``'s tokens with a random payload (normal, rounded to the layer's dtype) and
    router-like weights (a softmax over each token's top-k), reproducible from ``seed``; the
    first columns still name each token's origin, as in ``make_inputs``."""
    gen = torch.Generator()
    gen.manual_seed(mix_seed(seed, SEED_SALT, rank))
    n = shape.tokens
    x = torch.randn((n, shape.hidden), generator=gen)
    token = torch.arange(n)
    x[:, 0] = rank
    x[:, 1] = torch.div(token, ID_BASE, rounding_mode="floor").float()
    x[:, 2] = (token % ID_BASE).float()
    topk_idx = uniform_routing(gen, n, shape.experts, shape.topk)
    logits = torch.randn((n, shape.topk), generator=gen)
    weights = torch.softmax(logits, dim=1)
    dev = shape.device
    return Inputs(x.to(shape.dtype).to(dev), topk_idx.to(dev), weights.to(dev))


def random_grad(shape: Shape, rank: int, seed: int) -> torch.Tensor:
    """A random output gradient ``[tokens, hidden]`` in the layer's dtype, for ``rank``."""
    gen = torch.Generator()
    gen.manual_seed(mix_seed(seed, SEED_SALT, 104729, rank))
    g = torch.randn((shape.tokens, shape.hidden), generator=gen)
    return g.to(shape.dtype).to(shape.device)


def rank_factor(
    idx: torch.Tensor, weights: torch.Tensor, scales: torch.Tensor, rank: int, local: int
) -> torch.Tensor:
    """``[rows]`` float32: sum over the slots whose expert is on ``rank`` of weight * scale.

    Slot by slot (elementwise operations only), so the sending and the receiving rank, which
    compute it for differently sized sets of rows, get the same bits."""
    lo = rank * local
    factor = torch.zeros(idx.shape[0], dtype=torch.float32, device=idx.device)
    for slot in range(idx.shape[1]):
        e = idx[:, slot]
        here = (e >= lo) & (e < lo + local)
        term = weights[:, slot].float() * scales[e.clamp(min=0)]
        factor = factor + torch.where(here, term, torch.zeros_like(term))
    return factor


def cancelling_offsets(
    idx: torch.Tensor, gids: torch.Tensor, rank: int, local: int, node_of_rank: list[int]
) -> torch.Tensor:
    """``[rows]`` int64: the multiple of ``OFFSET`` that ``rank`` adds to each token's output.

    Of the m ranks of one node that receive a token, one (picked by the token's global id)
    adds -(m-1) offsets and the others +1 each: they cancel within the node, and any sum of
    some but not all of them is at least one offset away from 0, in whatever order a backend
    adds them. They cancel per node, because internode kernels may send a node's partial sum
    across in the payload's dtype by design."""
    world = len(node_of_rank)
    owner = torch.where(idx >= 0, idx.clamp(min=0) // local, torch.full_like(idx, -1))
    node = node_of_rank[rank]
    mates = [q for q in range(world) if node_of_rank[q] == node]
    receives = {q: (owner == q).any(dim=1) for q in mates}
    m = sum(receives[q].long() for q in mates)
    before = sum((receives[q].long() for q in mates if q < rank), torch.zeros_like(m))
    chosen = (gids % m.clamp(min=1)) == before
    offsets = torch.where(chosen, 1 - m, torch.ones_like(m))
    return torch.where(receives[rank] & (m >= 2), offsets, torch.zeros_like(m))


def ranks_reached(idx: torch.Tensor, local: int, node_of_rank: list[int]) -> int:
    """The most ranks of one node that any token of the routing ``idx`` (global top-k expert
    indices, -1 for none) reaches: the most rows its combine adds within that node.

    A sum of two rows is rounded once whether it is kept in the tokens' dtype or in fp32, so a
    running sum kept in bf16 changes no bit until a token reaches three ranks of one node
    (docs/probes.md, "Precision")."""
    owner = torch.where(idx >= 0, idx.clamp(min=0) // local, torch.full_like(idx, -1))
    most = 0
    for node in sorted(set(node_of_rank)):
        mates = [q for q in range(len(node_of_rank)) if node_of_rank[q] == node]
        reached = sum((owner == q).any(dim=1).long() for q in mates)
        if isinstance(reached, torch.Tensor) and reached.numel():
            most = max(most, int(reached.max()))
    return most


def contribution(
    x: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    gids: torch.Tensor,
    rank: int,
    local: int,
    scales: torch.Tensor,
    node_of_rank: list[int],
    cancel: bool,
) -> torch.Tensor:
    """The stand-in experts of ``rank`` applied to token rows ``x`` (routing ``idx``,
    ``weights``, global ids ``gids``): each row times its factor on that rank, plus (``cancel``)
    its cancelling offsets; identity columns 0, in ``x``'s dtype. 0 for a token not routed
    there."""
    out = x.float() * rank_factor(idx, weights, scales, rank, local)[:, None]
    if cancel:
        sigma = cancelling_offsets(idx, gids, rank, local, node_of_rank)
        out = out + (OFFSET * sigma.float())[:, None]
    return (out * id_mask(x.shape[1], x.device)).to(x.dtype)


def expected_sum(
    inputs: Inputs,
    gids: torch.Tensor,
    local: int,
    scales: torch.Tensor,
    node_of_rank: list[int],
    cancel: bool,
) -> torch.Tensor:
    """What combine must return for these tokens: the sum over every rank of its stand-in
    experts' output, in fp32 (exact for the cancelling outputs: they are coarse enough)."""
    total = torch.zeros(inputs.x.shape, dtype=torch.float32, device=inputs.x.device)
    for rank in range(len(node_of_rank)):
        total += contribution(
            inputs.x,
            inputs.topk_idx,
            inputs.topk_weights,
            gids,
            rank,
            local,
            scales,
            node_of_rank,
            cancel,
        ).float()
    return total
