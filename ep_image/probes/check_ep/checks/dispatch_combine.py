"""The ``dispatch_combine`` step: one dispatch and one combine, token by token against the
reference.

Why this module exists: it is the first check of the kernels, the one that says whether the
backend routes every token to the ranks of its experts and sums the experts' outputs back.
"""

from __future__ import annotations

from ep_image.probes._adapters.base import EPBackend
from ep_image.probes._ranks.runtime import Runtime, agree, sync
from ep_image.probes._report import Status, Step, StepFailed, timed_step
from ep_image.probes.check_ep import reference as ref
from ep_image.probes.check_ep.checks.context import (
    CheckContext,
    bound_text,
    dtype_name,
    expert_output_of,
    rows_of,
    safely,
    zero_rows,
)


def step_dispatch_combine(rt: Runtime, backend: EPBackend, ctx: CheckContext) -> Step:
    """One dispatch and one combine, compared token by token with the reference."""
    with timed_step("dispatch_combine") as step:
        inp = ctx.inputs
        d = backend.dispatch(inp.x, inp.topk_idx, inp.topk_weights)
        sync(rt)
        problems: list[str] = []
        rows = rows_of(d)
        problems += safely(
            problems,
            "dispatch",
            ref.dispatch_contract,
            d,
            inp.x,
            ctx.shape.topk,
            ctx.local,
            fallback=[],
        )
        unread = ref.DispatchCheck([], rows, int(ctx.expected.rows.numel()), [], [])
        check = safely(
            problems,
            "dispatch",
            ref.check_dispatch,
            d,
            ctx.global_routing,
            ctx.expected,
            ctx.local,
            fallback=unread,
        )
        y = safely(problems, "dispatch", expert_output_of, ctx, d, fallback=zero_rows(ctx, rows))
        out = backend.combine(y, getattr(d, "handle", None))
        sync(rt)
        problems += check.problems
        problems += ref.tensor_contract(
            "combine", out, ctx.shape.tokens, ctx.shape.hidden, y.dtype, y.device
        )
        c = ref.compare_tokens(out, ctx.expected_combine, ctx.tolerance)
        whole = ref.rel_diff(out.float(), ctx.expected_combine) if not c.shape else float("inf")
        step.data = {
            "received": check.received,
            "expected": check.expected,
            "per_expert": check.per_expert,
            "expected_per_expert": check.expected_per_expert,
            "rel_diff": c.worst,
            "worst_token": c.worst_token,
            "tokens_over_tolerance": c.over,
            "tokens_not_finite": c.nonfinite,
            "global_rel_diff": whole,
            "tolerance": ctx.tolerance,
        }
        if not c.ok:
            problems.append(
                "combine: "
                + ref.describe_tokens(c, "the top-k weighted sum", ctx.tolerance)
                + f", {dtype_name(ctx.shape.dtype)}: combine does not return the top-k "
                "weighted sum"
            )
        if problems:
            raise StepFailed(
                Status.FAIL,
                "; ".join(problems),
                "the backend routes or reduces tokens wrongly; compare with --backend torch "
                "and report it with this JSON",
                step.data,
            )
        step.detail = f"{check.received} tokens received, counts match; rel diff {c.worst:.2g}"
    return agree(rt, step, _summarize_dispatch_combine)


def _summarize_dispatch_combine(merged: Step, per_rank: list[Step]) -> None:
    datas = [s.data for s in per_rank]
    if not all("received" in d for d in datas):
        return
    recv = [d["received"] for d in datas]
    diff = max(d["rel_diff"] for d in datas)
    merged.data.update(
        received_per_rank=recv,
        expected_per_rank=[d["expected"] for d in datas],
        received_per_expert=[c for d in datas for c in d["per_expert"]],
        max_rel_diff=diff,
        tolerance=datas[0]["tolerance"],
    )
    if merged.status == Status.PASS:
        merged.detail = (
            f"tokens/rank {recv} match the reference; per-expert counts match; "
            + bound_text(diff, datas[0]["tolerance"])
        )
