"""What each rank must receive and get back, computed in plain torch from the global routing.

Why this module exists: the expectations come from every rank's inputs alone (all-gathered with
plain torch.distributed, never through the backend), so one set of them judges every backend:
which tokens a rank receives, for which local experts, and what combine returns.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ep_image.probes._adapters.torch_reference import all_gather_rows
from ep_image.probes._ranks.layer import ID_BASE, ID_COLUMNS
from ep_image.probes.check_ep.reference.inputs import Inputs, id_mask


@dataclasses.dataclass
class GlobalRouting:
    """Every rank's tokens and routing, concatenated in rank order (row = offset[rank] + token).

    Ranks may hold different numbers of tokens (``counts``), 0 included.
    """

    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    counts: list[int]
    world: int

    @property
    def total(self) -> int:
        return sum(self.counts)

    @property
    def offsets(self) -> list[int]:
        out, acc = [], 0
        for c in self.counts:
            out.append(acc)
            acc += c
        return out


def gather_uneven(t: torch.Tensor, counts: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's ``t`` (``counts[r]`` rows on rank r) in rank order."""
    longest = max(max(counts), 1)
    padded = t.new_zeros((longest, *t.shape[1:]))
    padded[: t.shape[0]] = t
    gathered = all_gather_rows(padded, group)
    parts = [gathered[r * longest : r * longest + c] for r, c in enumerate(counts)]
    return torch.cat(parts) if parts else gathered[:0]


def gather_global(inputs: Inputs, group: dist.ProcessGroup) -> GlobalRouting:
    """All-gather the inputs with plain torch.distributed (not through the backend)."""
    n = torch.tensor([inputs.x.shape[0]], dtype=torch.int64, device=inputs.x.device)
    counts = [int(c) for c in all_gather_rows(n, group).tolist()]
    return GlobalRouting(
        x=gather_uneven(inputs.x, counts, group),
        topk_idx=gather_uneven(inputs.topk_idx, counts, group),
        topk_weights=gather_uneven(inputs.topk_weights, counts, group),
        counts=counts,
        world=dist.get_world_size(group),
    )


@dataclasses.dataclass
class Expected:
    """What ``rank`` must receive: global row ids (sorted), per-expert counts, routing."""

    rows: torch.Tensor  # [n] sorted global row ids
    per_expert: list[int]  # [local experts]
    mask: torch.Tensor  # [n, local] bool: token uses that local expert
    weights: torch.Tensor  # [n, local] float32: its weight there (0 elsewhere)
    factor: torch.Tensor  # [global rows] float32: sum of weight * scale over this rank's experts


def expected_for_rank(
    g: GlobalRouting, rank: int, local: int, scales: torch.Tensor | None = None
) -> Expected:
    """Tokens routed to ``rank`` (those with any top-k expert in its range) and their routing."""
    lo = rank * local
    mine = (g.topk_idx >= lo) & (g.topk_idx < lo + local)
    rows = mine.any(dim=1).nonzero().squeeze(1)
    per_expert = torch.bincount(g.topk_idx[mine] - lo, minlength=local)
    mask, weights = dense_routing(
        torch.where(mine[rows], g.topk_idx[rows] - lo, torch.full_like(g.topk_idx[rows], -1)),
        g.topk_weights[rows],
        local,
    )
    if scales is None:
        factor = torch.zeros(g.total, device=g.x.device)
    else:
        factor = (g.topk_weights * scales[g.topk_idx.clamp(min=0)] * mine).sum(dim=1)
    return Expected(rows, [int(c) for c in per_expert.tolist()], mask, weights, factor)


def dense_routing(
    local_idx: torch.Tensor, weights: torch.Tensor, local: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k (local index, weight) pairs as a dense [rows, local] mask and weight matrix."""
    rows = local_idx.shape[0]
    idx = local_idx.to(torch.int64)
    valid = idx >= 0
    # Slots with idx -1 go to a spare last column, dropped at the end.
    slot = torch.where(valid, idx, torch.full_like(idx, local))
    mask = torch.zeros((rows, local + 1), dtype=torch.bool, device=idx.device)
    dense = torch.zeros((rows, local + 1), dtype=torch.float32, device=idx.device)
    mask.scatter_(1, slot, True)
    dense.scatter_add_(1, slot, weights.float())
    mask, dense = mask[:, :local], dense[:, :local]
    return mask, dense


def decode_ids(recv_x: torch.Tensor, g: GlobalRouting) -> torch.Tensor:
    """Global row id claimed by each received row (-1 where the id columns are not valid)."""
    cols = recv_x[:, :ID_COLUMNS].float()
    src, hi, lo = cols[:, 0], cols[:, 1], cols[:, 2]
    integral = (cols == cols.round()).all(dim=1)
    in_range = (src >= 0) & (src < g.world) & (hi >= 0) & (lo >= 0) & (lo < ID_BASE)
    rank = torch.where(in_range & integral, src, torch.zeros_like(src)).round().to(torch.int64)
    token = (hi * ID_BASE + lo).round().to(torch.int64)
    counts = torch.tensor(g.counts, dtype=torch.int64, device=recv_x.device)
    offsets = torch.tensor(g.offsets, dtype=torch.int64, device=recv_x.device)
    valid = integral & in_range & (token < counts[rank])
    return torch.where(valid, offsets[rank] + token, torch.full_like(token, -1))


def name_row(g: GlobalRouting, row: int) -> str:
    """``token T of rank R`` for a global row id."""
    offsets = g.offsets
    rank = max(r for r in range(g.world) if offsets[r] <= row and g.counts[r] > 0)
    return f"token {row - offsets[rank]} of rank {rank}"


def row_factor(exp: Expected, ids: torch.Tensor) -> torch.Tensor:
    """The stand-in experts' total factor for each received row, from the reference routing
    of the token the row names (0 for a row that names none)."""
    if exp.factor.numel() == 0:
        return torch.zeros(ids.shape, device=ids.device)
    return torch.where(ids >= 0, exp.factor[ids.clamp(min=0)], torch.zeros_like(ids).float())


def expert_output(rows: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """The stand-in experts applied to ``rows``: each row times its factor, identity columns 0."""
    mask = id_mask(rows.shape[1], rows.device)
    return (rows.float() * factor[:, None] * mask).to(rows.dtype)


def token_scale(inputs: Inputs, scales: torch.Tensor) -> torch.Tensor:
    """The factor per local token, from its own routing: sum_k w_k * scale(e_k) (-1 slots: 0)."""
    idx = inputs.topk_idx
    valid = idx >= 0
    return (inputs.topk_weights * scales[idx.clamp(min=0)] * valid).sum(dim=1)


def expected_combine(inputs: Inputs, scales: torch.Tensor) -> torch.Tensor:
    """What combine must return on this rank: each token times its top-k weighted scale."""
    rows = inputs.x.float() * token_scale(inputs, scales)[:, None]
    return rows * id_mask(rows.shape[1], rows.device)
