"""What each rank sends: tokens and routing chosen so that every right answer is exact in bf16.

Why this module exists: the reference can only demand bit-exact results (and so catch one lost
token) if its inputs make them exact: payloads of +-2**j, top-k weights in quarters, expert
scales in quarters, each token's origin in its first columns. See docs/probes.md, "Exact
expectations".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ep_image.probes._adapters.base import Shape
from ep_image.probes._ranks.layer import ID_BASE, ID_COLUMNS

#: Bounds where the inputs cannot be exact (top-k above 36): per token, relative.
TOLERANCE = {torch.float32: 5e-6, torch.bfloat16: 1e-2, torch.float16: 1e-2}


#: Expert scales are 1 + (e % SCALE_STEPS) / SCALE_STEPS: multiples of 1/4 up to 7/4.
SCALE_STEPS = 4


#: An expert output's factor times 16 must stay below 256 (8 significant bits, bf16's).
EXACT_LIMIT = 255


Router = Callable[[torch.Generator, int], torch.Tensor]


#: Payload elements: exact in every dtype, and after any power-of-two scaling.
PAYLOAD_VALUES = (0.5, -0.5, 1.0, -1.0, 2.0, -2.0)


def weight_steps(topk: int) -> int:
    """Largest top-k weight, in quarters, that keeps every factor exact (0: none does)."""
    return min(4, EXACT_LIMIT // ((2 * SCALE_STEPS - 1) * topk))


def exact(topk: int) -> bool:
    """Whether combined tokens and gradients are exact at this top-k (see the module doc)."""
    return weight_steps(topk) >= 1


def tolerance_for(dtype: torch.dtype, topk: int) -> float:
    """The per-token bound for combine and gradients: 0 when the inputs are exact."""
    return 0.0 if exact(topk) else TOLERANCE.get(dtype, 1e-2)


@dataclasses.dataclass
class Inputs:
    """One rank's MoE layer input: tokens and their top-k routing."""

    x: torch.Tensor  # [tokens, hidden] shape.dtype
    topk_idx: torch.Tensor  # [tokens, topk] int64, distinct experts per token, -1: no expert
    topk_weights: torch.Tensor  # [tokens, topk] float32, 0 where the slot is -1


def mix_seed(*parts: int) -> int:
    """One generator seed from several integers (seed, rank, layout ...), stable everywhere."""
    value = 0
    for part in parts:
        value = (value * 1_000_003 + int(part)) % (1 << 62)
    return value


def payload(gen: torch.Generator, rows: int, cols: int) -> torch.Tensor:
    """``[rows, cols]`` float32 of +-2**j, j in {-1, 0, 1}: exact in every dtype, any scale."""
    code = torch.randint(0, len(PAYLOAD_VALUES), (rows, cols), generator=gen)
    return torch.tensor(PAYLOAD_VALUES)[code]


def uniform_routing(gen: torch.Generator, tokens: int, experts: int, topk: int) -> torch.Tensor:
    """Each token's top-k distinct experts, uniformly at random (``[tokens, topk]`` int64)."""
    scores = torch.rand((tokens, experts), generator=gen)
    return scores.topk(topk, dim=1).indices.to(torch.int64)


def make_inputs(
    shape: Shape,
    rank: int,
    seed: int,
    tokens: int | None = None,
    route: Router | None = None,
) -> Inputs:
    """Tokens and routing for ``rank``, reproducible from ``seed`` (generated on the CPU).

    ``route(gen, tokens)`` gives the top-k expert indices (-1 for a slot that routes
    nowhere); uniform random routing when absent. Weights are multiples of 1/4 (0 for -1).
    """
    gen = torch.Generator()
    gen.manual_seed(mix_seed(seed, rank))
    n = shape.tokens if tokens is None else tokens
    x = torch.empty((n, shape.hidden), dtype=torch.float32)
    x[:, ID_COLUMNS:] = payload(gen, n, shape.hidden - ID_COLUMNS)
    token = torch.arange(n)
    x[:, 0] = rank
    x[:, 1] = torch.div(token, ID_BASE, rounding_mode="floor").float()
    x[:, 2] = (token % ID_BASE).float()
    if route is None:
        topk_idx = uniform_routing(gen, n, shape.experts, shape.topk)
    else:
        topk_idx = route(gen, n)
    steps = max(weight_steps(shape.topk), 1)
    quarters = torch.randint(1, steps + 1, (n, shape.topk), generator=gen).float()
    weights = torch.where(topk_idx >= 0, quarters / 4, torch.zeros_like(quarters))
    dev = shape.device
    return Inputs(x.to(shape.dtype).to(dev), topk_idx.to(dev), weights.to(dev))


def output_grad(shape: Shape, rows: int, seed: int, rank: int, salt: int = 7919) -> torch.Tensor:
    """An exact output gradient ``[rows, hidden]`` for ``rank`` (payload values everywhere)."""
    gen = torch.Generator()
    gen.manual_seed(mix_seed(seed, salt, rank))
    g = payload(gen, rows, shape.hidden)
    return g.to(shape.dtype).to(shape.device)


def expert_scales(experts: int, device: torch.device) -> torch.Tensor:
    """The stand-in expert: expert ``e`` multiplies its tokens by ``1 + (e % 4) / 4``.

    Neighbouring experts differ, so a token handed to the expert next to its own changes the
    combined result (which expert a row goes to is also checked exactly after dispatch).
    """
    e = torch.arange(experts, device=device)
    return 1.0 + (e % SCALE_STEPS).float() / SCALE_STEPS


def id_mask(hidden: int, device: torch.device) -> torch.Tensor:
    """``[hidden]`` float32: 0 for the identity columns, 1 for the payload."""
    mask = torch.ones(hidden, device=device)
    mask[:ID_COLUMNS] = 0
    return mask


def scale_payload(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x`` with its payload (not its identity columns) times ``factor`` (a power of two:
    exact): new activations for the same tokens."""
    out = x.clone()
    out[:, ID_COLUMNS:] *= factor
    return out


#: The payload factor of the timed call ``i``: consecutive calls differ, all exact.
def call_factor(i: int) -> float:
    return (-1.0) ** i * 2.0 ** ((i % 3) - 1)
