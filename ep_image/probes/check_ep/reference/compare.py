"""Outputs against the expectations: dispatched rows, tokens, the output contract, and the
sentences that name the first thing wrong.

Why this module exists: every check (the layer-shape steps, the scenarios, the timed calls)
compares the same way, so a failure reads the same wherever it is found: the first token,
row or expert that differs, and how many do.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ep_image.probes._adapters.base import Dispatched
from ep_image.probes.check_ep.reference.expected import (
    Expected,
    GlobalRouting,
    decode_ids,
    dense_routing,
    name_row,
)
from ep_image.probes.check_ep.reference.inputs import scale_payload
from ep_image.probes.check_ep.reference.precision import calc_diff


@dataclasses.dataclass
class DispatchCheck:
    """Result of comparing one rank's dispatch output with the expectation."""

    problems: list[str]
    received: int
    expected: int
    per_expert: list[int]
    expected_per_expert: list[int]


def check_dispatch(
    d: Dispatched,
    g: GlobalRouting,
    exp: Expected,
    local: int,
    weights_bound: float = 0.0,
) -> DispatchCheck:
    """Counts per rank and per expert, token identity and payload, routing of each row; the
    top-k weights bit for bit, or (``weights_bound``) within that ``calc_diff`` of the sent
    ones."""
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
        mask, weights = dense_routing(idx, d.recv_topk_weights[order], local)
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
            diff = calc_diff(weights, exp.weights)
            if diff > weights_bound:
                within = f"calc_diff {diff:.3g} > {weights_bound:g}; " if weights_bound else ""
                problems.append(
                    f"{int(bad.sum())} received tokens carry wrong top-k weights "
                    f"({within}first: {name_row(g, first)})"
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
    counts = d.num_recv_per_expert
    if not isinstance(counts, list | tuple | torch.Tensor):
        what = type(counts).__name__
        problems.append(f"dispatch returned num_recv_per_expert {what}, not a list of counts")
        counts = []
    if not isinstance(idx, torch.Tensor) or not isinstance(w, torch.Tensor):
        found = f"{type(idx).__name__} and {type(w).__name__}"
        return [*problems, f"dispatch returned recv_topk_idx and recv_topk_weights {found}"]
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
    if len(counts) != local:
        got = len(counts)
        problems.append(f"dispatch returned {got} per-expert counts for {local} local experts")
    return problems


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


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


def same_values(a: Any, b: Any) -> bool:
    """``a`` and ``b`` hold the same values, NaN equal to NaN (an output kept for the backward
    pass that held a NaN when returned has not changed if it still does)."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.shape != b.shape:
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all()) if a.numel() else True


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
