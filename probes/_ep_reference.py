"""What dispatch and combine *should* produce, computed in plain torch from the global routing.

Why this module exists: a check that asks the backend under test for its own expected values
proves nothing. Everything here is derived from the inputs alone - every rank's tokens and
top-k routing, all-gathered - with simple tensor operations and no call into any backend, so
the same expectations judge DeepEP v1, v2, HybridEP and the torch reference backend.

How tokens are recognised after dispatch: the first three columns of each token carry its
origin (source rank, token index // 256, token index % 256), integers that are exact in
bf16 and fp32; the rest of the row is random. A received row therefore names the token it
claims to be, and its payload is compared bit for bit with what that token's rank sent.

Tolerances apply to every token on its own (relative difference of one token's row,
||out_t - ref_t||_2 / ||ref_t||_2): fp32 5e-6 (DeepEP's own combine threshold); bf16/fp16
1e-2, because expert outputs are rounded to 8 mantissa bits before the sum and again after
it. Every contribution to a token has the same sign pattern (positive weights and expert
scales times the same row), so rounding never cancels and stays below 2**-8 per element,
while a token whose output is lost (relative difference 1) or one of whose top-k
contributions is lost (at least 0.5 / 24 of its sum) fails at every shape and dtype. A
tolerance over the whole tensor would not do: one lost token of 8192 moves it by ~0.01.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from ep_adapters import Dispatched, Shape, all_gather_rows

ID_COLUMNS = 3
ID_BASE = 256
MAX_TOKENS = ID_BASE * ID_BASE  # token index must fit two base-256 digits
MAX_RANKS = ID_BASE  # rank id must be exact in bf16

TOLERANCE = {torch.float32: 5e-6, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def tolerance_for(dtype: torch.dtype) -> float:
    return TOLERANCE.get(dtype, 1e-2)


@dataclasses.dataclass
class Inputs:
    """One rank's MoE layer input: tokens and their top-k routing."""

    x: torch.Tensor  # [tokens, hidden] shape.dtype
    topk_idx: torch.Tensor  # [tokens, topk] int64, distinct experts per token
    topk_weights: torch.Tensor  # [tokens, topk] float32


def make_inputs(shape: Shape, rank: int, seed: int) -> Inputs:
    """Random tokens and routing for ``rank``, reproducible from ``seed``."""
    gen = torch.Generator(device=shape.device)
    gen.manual_seed(seed * 1_000_003 + rank)
    dev = shape.device
    x = torch.randn((shape.tokens, shape.hidden), generator=gen, device=dev)
    token = torch.arange(shape.tokens, device=dev)
    x[:, 0] = rank
    x[:, 1] = torch.div(token, ID_BASE, rounding_mode="floor").float()
    x[:, 2] = (token % ID_BASE).float()
    scores = torch.rand((shape.tokens, shape.experts), generator=gen, device=dev)
    topk_idx = scores.topk(shape.topk, dim=1).indices.to(torch.int64)
    topk_weights = torch.rand((shape.tokens, shape.topk), generator=gen, device=dev) + 0.5
    return Inputs(x.to(shape.dtype), topk_idx, topk_weights.float())


def expert_scales(experts: int, device: torch.device) -> torch.Tensor:
    """The stand-in expert: expert ``e`` multiplies its tokens by ``1 + e / experts``.

    Distinct per expert, so a token handed to the wrong expert changes the combined result.
    """
    return 1.0 + torch.arange(experts, device=device, dtype=torch.float32) / experts


@dataclasses.dataclass
class GlobalRouting:
    """Every rank's tokens and routing, concatenated in rank order (row = rank*T + token)."""

    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    tokens: int
    world: int


def gather_global(inputs: Inputs, group: dist.ProcessGroup) -> GlobalRouting:
    """All-gather the inputs with plain torch.distributed (not through the backend)."""
    return GlobalRouting(
        x=all_gather_rows(inputs.x, group),
        topk_idx=all_gather_rows(inputs.topk_idx, group),
        topk_weights=all_gather_rows(inputs.topk_weights, group),
        tokens=inputs.x.shape[0],
        world=dist.get_world_size(group),
    )


@dataclasses.dataclass
class Expected:
    """What ``rank`` must receive: global row ids (sorted), per-expert counts, routing."""

    rows: torch.Tensor  # [n] sorted global row ids
    per_expert: list[int]  # [local experts]
    mask: torch.Tensor  # [n, local] bool: token uses that local expert
    weights: torch.Tensor  # [n, local] float32: its weight there (0 elsewhere)


def expected_for_rank(g: GlobalRouting, rank: int, local: int) -> Expected:
    """Tokens routed to ``rank`` (those with any top-k expert in its range) and their routing."""
    lo = rank * local
    mine = (g.topk_idx >= lo) & (g.topk_idx < lo + local)
    rows = mine.any(dim=1).nonzero().squeeze(1)
    per_expert = torch.bincount(g.topk_idx[mine] - lo, minlength=local)
    mask, weights = _dense_routing(
        torch.where(mine[rows], g.topk_idx[rows] - lo, torch.full_like(g.topk_idx[rows], -1)),
        g.topk_weights[rows],
        local,
    )
    return Expected(rows, [int(c) for c in per_expert.tolist()], mask, weights)


def _dense_routing(
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


def decode_ids(recv_x: torch.Tensor, tokens: int, world: int) -> torch.Tensor:
    """Global row id claimed by each received row (-1 where the id columns are not valid)."""
    cols = recv_x[:, :ID_COLUMNS].float()
    src, hi, lo = cols[:, 0], cols[:, 1], cols[:, 2]
    ids = (src * tokens + hi * ID_BASE + lo).round().to(torch.int64)
    integral = (cols == cols.round()).all(dim=1)
    in_range = (src >= 0) & (src < world) & (hi >= 0) & (lo >= 0) & (lo < ID_BASE)
    token = hi * ID_BASE + lo
    valid = integral & in_range & (token < tokens)
    return torch.where(valid, ids, torch.full_like(ids, -1))


@dataclasses.dataclass
class DispatchCheck:
    """Result of comparing one rank's dispatch output with the expectation."""

    problems: list[str]
    received: int
    expected: int
    per_expert: list[int]
    expected_per_expert: list[int]


def check_dispatch(d: Dispatched, g: GlobalRouting, exp: Expected, local: int) -> DispatchCheck:
    """Counts per rank and per expert, token identity and payload, routing of each row."""
    problems: list[str] = []
    n = int(d.recv_x.shape[0])
    want = int(exp.rows.numel())
    per_expert = [int(c) for c in d.num_recv_per_expert]
    if n != want:
        problems.append(f"received {n} tokens, expected {want} (from the all-gathered routing)")
    if per_expert != exp.per_expert:
        width = max(len(per_expert), len(exp.per_expert))
        got = [*per_expert, *[None] * (width - len(per_expert))]
        ref = [*exp.per_expert, *[None] * (width - len(exp.per_expert))]
        bad = [e for e in range(width) if got[e] != ref[e]]
        e = bad[0]
        problems.append(
            f"local expert {e} received {got[e]} tokens, expected {ref[e]} "
            f"({len(bad)} of {local} experts differ)"
        )

    ids = decode_ids(d.recv_x, g.tokens, g.world)
    order = ids.argsort()
    sorted_ids = ids[order]
    if not torch.equal(sorted_ids, exp.rows):
        got_set = set(sorted_ids.tolist())
        want_set = set(exp.rows.tolist())
        dupes = n - len(got_set)
        problems.append(
            f"received rows are not the tokens routed here: {len(want_set - got_set)} missing, "
            f"{len(got_set - want_set - {-1})} unexpected, {int((ids < 0).sum())} unreadable, "
            f"{dupes} duplicated"
        )
        return DispatchCheck(problems, n, want, per_expert, exp.per_expert)

    # Same tokens: compare payloads and routing row by row, aligned by token id.
    recv_sorted = d.recv_x[order]
    if not torch.equal(recv_sorted, g.x[sorted_ids]):
        differ = int((recv_sorted != g.x[sorted_ids]).any(dim=1).sum())
        problems.append(f"{differ} received token payloads differ from what was sent")
    idx = d.recv_topk_idx[order].to(torch.int64)
    if bool(((idx < -1) | (idx >= local)).any()):
        problems.append(f"recv_topk_idx holds values outside [-1, {local})")
    else:
        mask, weights = _dense_routing(idx, d.recv_topk_weights[order], local)
        if not torch.equal(mask, exp.mask):
            differ = int((mask != exp.mask).any(dim=1).sum())
            problems.append(f"{differ} received tokens carry the wrong local experts")
        elif not torch.equal(weights, exp.weights):
            differ = int((weights != exp.weights).any(dim=1).sum())
            problems.append(f"{differ} received tokens carry wrong top-k weights")
        counted = mask.sum(dim=0).tolist()
        if [int(c) for c in counted] != per_expert and per_expert == exp.per_expert:
            problems.append("num_recv_per_expert disagrees with recv_topk_idx")
    return DispatchCheck(problems, n, want, per_expert, exp.per_expert)


def row_scale(
    recv_topk_idx: torch.Tensor,
    recv_topk_weights: torch.Tensor,
    scales: torch.Tensor,
    rank: int,
    local: int,
) -> torch.Tensor:
    """The stand-in experts' total factor per received row: sum of weight * expert scale."""
    idx = recv_topk_idx.to(torch.int64)
    valid = idx >= 0
    factor = scales[(rank * local + idx.clamp(min=0)).clamp(max=scales.numel() - 1)]
    return torch.where(valid, recv_topk_weights.float() * factor, torch.zeros_like(factor)).sum(1)


def token_scale(inputs: Inputs, scales: torch.Tensor) -> torch.Tensor:
    """The same factor per local token, from its own routing: sum_k w_k * scale(e_k)."""
    return (inputs.topk_weights * scales[inputs.topk_idx]).sum(dim=1)


def expected_combine(inputs: Inputs, scales: torch.Tensor) -> torch.Tensor:
    """What combine must return on this rank: each token times its top-k weighted scale."""
    return inputs.x.float() * token_scale(inputs, scales)[:, None]


def per_token_rel_diff(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Each row's ||out_t - ref_t|| / ||ref_t|| (inf everywhere when the shapes differ)."""
    if out.shape != ref.shape:
        return torch.full((max(ref.shape[0], 1),), float("inf"), device=ref.device)
    ref64 = ref.double()
    num = (out.double() - ref64).norm(dim=1)
    denom = ref64.norm(dim=1)
    return torch.where(denom > 0, num / denom.clamp(min=1e-300), num)


def worst_token(diffs: torch.Tensor) -> tuple[float, int]:
    """The largest per-token difference and the token it belongs to (-1 for no tokens)."""
    if diffs.numel() == 0:
        return 0.0, -1
    value, index = diffs.max(dim=0)
    return float(value), int(index)


def dispatch_wrong(recv_x: torch.Tensor, g: GlobalRouting, exp: Expected) -> torch.Tensor:
    """A 0-dim bool: ``recv_x`` lacks a token routed here, holds another, or changed a bit.

    Rows may come in any order; repeated rows are the replay step's concern (a shape that
    changes between identical calls), not this one's. Computed on the device without a host
    sync, so each timed call is checked after its timing ends.
    """
    ids = decode_ids(recv_x, g.tokens, g.world)
    valid = ids >= 0
    safe = ids.clamp(min=0)
    bad_rows = ~valid | ~(recv_x == g.x[safe]).all(dim=1)
    wanted = torch.zeros(g.world * g.tokens, dtype=torch.bool, device=recv_x.device)
    wanted[exp.rows] = True
    seen = torch.zeros(g.world * g.tokens, dtype=torch.int32, device=recv_x.device)
    seen.index_put_((safe,), valid.to(torch.int32), accumulate=True)
    return bad_rows.any() | (valid & ~wanted[safe]).any() | (wanted & (seen == 0)).any()


def rel_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (inf when the shapes differ)."""
    if out.shape != ref.shape:
        return float("inf")
    ref64 = ref.double()
    denom = float(ref64.norm())
    num = float((out.double() - ref64).norm())
    return num / denom if denom > 0 else num
