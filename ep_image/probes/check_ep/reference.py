"""What dispatch and combine *should* produce, computed in plain torch from the global routing.

Derived from every rank's inputs alone, never from a backend, so one set of expectations judges
every backend; inputs are chosen so the right answer is exact in bf16. See docs/probes.md,
section "Steps" (the identity columns and "Exact expectations").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ep_image.probes.check_ep.adapters import Dispatched, Shape, all_gather_rows

ID_COLUMNS = 3
ID_BASE = 256
MAX_TOKENS = ID_BASE * ID_BASE  # token index must fit two base-256 digits
MAX_RANKS = ID_BASE  # rank id must be exact in bf16

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
    mask, weights = _dense_routing(
        torch.where(mine[rows], g.topk_idx[rows] - lo, torch.full_like(g.topk_idx[rows], -1)),
        g.topk_weights[rows],
        local,
    )
    if scales is None:
        factor = torch.zeros(g.total, device=g.x.device)
    else:
        factor = (g.topk_weights * scales[g.topk_idx.clamp(min=0)] * mine).sum(dim=1)
    return Expected(rows, [int(c) for c in per_expert.tolist()], mask, weights, factor)


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

    ids = decode_ids(d.recv_x, g)
    order = ids.argsort()
    sorted_ids = ids[order]
    if not torch.equal(sorted_ids, exp.rows):
        got_set = set(sorted_ids.tolist())
        want_set = set(exp.rows.tolist())
        missing = sorted(want_set - got_set)
        unexpected = sorted(got_set - want_set - {-1})
        dupes = n - len(got_set)
        first = []
        if missing:
            first.append(f"first missing: {name_row(g, missing[0])}")
        if unexpected:
            first.append(f"first unexpected: {name_row(g, unexpected[0])}")
        problems.append(
            f"received rows are not the tokens routed here: {len(missing)} missing, "
            f"{len(unexpected)} unexpected, {int((ids < 0).sum())} unreadable, "
            f"{dupes} duplicated" + (f" ({'; '.join(first)})" if first else "")
        )
        return DispatchCheck(problems, n, want, per_expert, exp.per_expert)

    # Same tokens: compare payloads and routing row by row, aligned by token id.
    recv_sorted = d.recv_x[order]
    sent = g.x[sorted_ids]
    if not torch.equal(recv_sorted, sent):
        bad = (recv_sorted != sent).any(dim=1)
        first = int(sorted_ids[bad.nonzero()[0, 0]])
        problems.append(
            f"{int(bad.sum())} received token payloads differ from what was sent "
            f"(first: {name_row(g, first)})"
        )
    idx = d.recv_topk_idx[order].to(torch.int64)
    if bool(((idx < -1) | (idx >= local)).any()):
        problems.append(f"recv_topk_idx holds values outside [-1, {local})")
    else:
        mask, weights = _dense_routing(idx, d.recv_topk_weights[order], local)
        if not torch.equal(mask, exp.mask):
            bad = (mask != exp.mask).any(dim=1)
            first = int(sorted_ids[bad.nonzero()[0, 0]])
            problems.append(
                f"{int(bad.sum())} received tokens carry the wrong local experts "
                f"(first: {name_row(g, first)})"
            )
        elif not torch.equal(weights, exp.weights):
            bad = (weights != exp.weights).any(dim=1)
            first = int(sorted_ids[bad.nonzero()[0, 0]])
            problems.append(
                f"{int(bad.sum())} received tokens carry wrong top-k weights "
                f"(first: {name_row(g, first)})"
            )
        counted = mask.sum(dim=0).tolist()
        if [int(c) for c in counted] != per_expert and per_expert == exp.per_expert:
            problems.append("num_recv_per_expert disagrees with recv_topk_idx")
    return DispatchCheck(problems, n, want, per_expert, exp.per_expert)


def tensor_contract(
    what: str, out: Any, rows: int, hidden: int, dtype: torch.dtype, device: torch.device
) -> list[str]:
    """``out`` is a contiguous ``[rows, hidden]`` tensor of ``dtype`` on ``device``.

    The output contract of every operation: what training code feeds the next layer must
    have the layout and precision it gave (a float32 combine of bf16 tokens doubles the
    activation memory; a strided one breaks the kernels that follow).
    """
    if not isinstance(out, torch.Tensor):
        return [f"{what} returned {type(out).__name__}, not a tensor"]
    problems = []
    if out.dtype != dtype:
        problems.append(
            f"{what} returned {_dtype_name(out.dtype)}, its input was {_dtype_name(dtype)}"
        )
    if tuple(out.shape) != (rows, hidden):
        problems.append(f"{what} returned shape {list(out.shape)}, expected [{rows}, {hidden}]")
    elif not out.is_contiguous():
        problems.append(f"{what} returned a non-contiguous tensor (strides {list(out.stride())})")
    if out.device != device:
        problems.append(f"{what} returned a tensor on {out.device}, its input was on {device}")
    return problems


def dispatch_contract(d: Dispatched, x: torch.Tensor, topk: int, local: int) -> list[str]:
    """Dispatch's outputs: rows in the token dtype and layout, top-k routing beside them."""
    if not isinstance(d.recv_x, torch.Tensor) or d.recv_x.dim() != 2:
        return ["dispatch returned recv_x that is not a [rows, hidden] tensor"]
    rows = int(d.recv_x.shape[0])
    problems = tensor_contract("dispatch", d.recv_x, rows, x.shape[1], x.dtype, x.device)
    idx, w = d.recv_topk_idx, d.recv_topk_weights
    if tuple(idx.shape) != (rows, topk) or idx.dtype.is_floating_point:
        problems.append(
            f"dispatch returned recv_topk_idx {idx.dtype} {list(idx.shape)}, expected integer "
            f"[{rows}, {topk}]"
        )
    if tuple(w.shape) != (rows, topk) or w.dtype != torch.float32:
        problems.append(
            f"dispatch returned recv_topk_weights {w.dtype} {list(w.shape)}, expected float32 "
            f"[{rows}, {topk}]"
        )
    if len(d.num_recv_per_expert) != local:
        problems.append(
            f"dispatch returned {len(d.num_recv_per_expert)} per-expert counts for {local} "
            "local experts"
        )
    return problems


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


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


def scale_payload(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x`` with its payload (not its identity columns) times ``factor`` (a power of two:
    exact): new activations for the same tokens."""
    out = x.clone()
    out[:, ID_COLUMNS:] *= factor
    return out


#: The payload factor of the timed call ``i``: consecutive calls differ, all exact.
def call_factor(i: int) -> float:
    return (-1.0) ** i * 2.0 ** ((i % 3) - 1)


def per_token_rel_diff(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Each row's ||out_t - ref_t|| / ||ref_t|| (||out_t - ref_t|| where ref_t is 0); inf for a
    row holding a non-finite value, and everywhere when the shapes differ."""
    if out.shape != ref.shape:
        return torch.full((max(ref.shape[0], 1),), float("inf"), device=ref.device)
    ref64 = ref.double()
    num = (out.double() - ref64).norm(dim=1)
    denom = ref64.norm(dim=1)
    diffs = torch.where(denom > 0, num / denom.clamp(min=1e-300), num)
    finite = torch.isfinite(out).all(dim=1) & torch.isfinite(diffs)
    return torch.where(finite, diffs, torch.full_like(diffs, float("inf")))


@dataclasses.dataclass
class TokenCompare:
    """Per-token comparison of an output with the reference."""

    diffs: torch.Tensor
    tokens: int
    over: int  # tokens beyond the bound (non-finite ones included; all on a shape mismatch)
    nonfinite: int  # tokens holding NaN or inf
    first_over: int
    first_nonfinite: int
    worst: float
    worst_token: int
    shape: str = ""  # what came back, when its shape is not the reference's

    @property
    def ok(self) -> bool:
        return self.over == 0 and not self.shape


def compare_tokens(out: Any, ref: torch.Tensor, tolerance: float) -> TokenCompare:
    """Compare ``out`` with ``ref`` row by row; a non-finite row is always over the bound."""
    rows = int(ref.shape[0])
    if not isinstance(out, torch.Tensor) or out.shape != ref.shape:
        got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        inf = torch.full((rows,), float("inf"))
        return TokenCompare(inf, rows, rows, 0, 0, -1, float("inf"), 0, f"{got}")
    diffs = per_token_rel_diff(out.float(), ref)
    if diffs.numel() == 0:
        return TokenCompare(diffs, 0, 0, 0, -1, -1, 0.0, -1)
    nonfinite = ~torch.isfinite(out.float()).all(dim=1)
    over = diffs > tolerance
    worst, worst_token = diffs.max(dim=0)
    return TokenCompare(
        diffs=diffs,
        tokens=rows,
        over=int(over.sum()),
        nonfinite=int(nonfinite.sum()),
        first_over=int(over.nonzero()[0, 0]) if bool(over.any()) else -1,
        first_nonfinite=int(nonfinite.nonzero()[0, 0]) if bool(nonfinite.any()) else -1,
        worst=float(worst),
        worst_token=int(worst_token),
    )


def describe_tokens(c: TokenCompare, what: str, tolerance: float) -> str:
    """``N of M tokens differ from <what> ...``, naming the first wrong and non-finite token."""
    if c.shape:
        return f"returned {c.shape} where {c.tokens} tokens were expected"
    bound = "must be equal" if tolerance == 0 else f"by more than {tolerance:g}"
    text = (
        f"{c.over} of {c.tokens} tokens differ from {what} ({bound}; first: token "
        f"{c.first_over}; worst: token {c.worst_token}, relative difference {c.worst:.3g}"
    )
    if c.nonfinite:
        text += f"; {c.nonfinite} hold NaN or inf, first token {c.first_nonfinite}"
    return text + ")"


def compare_rows(out: Any, want: torch.Tensor) -> tuple[int, int]:
    """Rows of ``out`` that are not bit-identical to ``want`` (count, first; -1 for none).
    A shape mismatch counts every row."""
    rows = int(want.shape[0])
    if not isinstance(out, torch.Tensor) or out.shape != want.shape:
        return rows, 0 if rows else -1
    bad = (out != want).any(dim=1) if rows else torch.zeros(0, dtype=torch.bool)
    if not bool(bad.any()):
        return 0, -1
    return int(bad.sum()), int(bad.nonzero()[0, 0])


def dispatch_wrong(
    recv_x: torch.Tensor, g: GlobalRouting, exp: Expected, factor: float = 1.0
) -> torch.Tensor:
    """A 0-dim bool: ``recv_x`` lacks a token routed here, holds another, or changed a bit.

    ``factor`` is the power of two the sender's payload was scaled by (identity columns
    unscaled). Rows may come in any order; repeated rows are the replay step's concern (a
    shape that changes between identical calls), not this one's. Computed on the device
    without a host sync, so each timed call is checked after its timing ends.
    """
    ids = decode_ids(recv_x, g)
    valid = ids >= 0
    safe = ids.clamp(min=0)
    got = recv_x if factor == 1.0 else scale_payload(recv_x, 1.0 / factor)
    bad_rows = ~valid | ~(got == g.x[safe]).all(dim=1)
    wanted = torch.zeros(g.total + 1, dtype=torch.bool, device=recv_x.device)
    wanted[exp.rows] = True
    seen = torch.zeros(g.total + 1, dtype=torch.int32, device=recv_x.device)
    seen.index_put_((safe,), valid.to(torch.int32), accumulate=True)
    missing = (wanted & (seen == 0)).any()
    return bad_rows.any() | (valid & ~wanted[safe]).any() | missing


def rel_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (inf when the shapes differ or out is not finite)."""
    if out.shape != ref.shape:
        return float("inf")
    if out.numel() and not bool(torch.isfinite(out).all()):
        return float("inf")
    ref64 = ref.double()
    denom = float(ref64.norm())
    num = float((out.double() - ref64).norm())
    return num / denom if denom > 0 else num
