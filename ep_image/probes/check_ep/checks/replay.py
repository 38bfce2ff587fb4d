"""The ``replay`` step: the same routing dispatched again must give the same rows, bit for bit.

Why this module exists: activation-checkpoint recompute dispatches a layer's routing a second
time and fails on rows whose number or content changed ("recomputed values have different
metadata"); a race shows here too.
"""

from __future__ import annotations

from ep_image.probes._adapters.base import EPBackend
from ep_image.probes._ranks.runtime import Runtime, agree, sync
from ep_image.probes._report import Status, Step, StepFailed, timed_step
from ep_image.probes.check_ep import reference as ref
from ep_image.probes.check_ep.checks.context import CheckContext, rows_of, safely


def step_replay(rt: Runtime, backend: EPBackend, ctx: CheckContext, replays: int) -> Step:
    """Dispatch the same routing again: rows, counts and every payload bit must not change."""
    with timed_step("replay") as step:
        inp = ctx.inputs
        rows: list[int] = []
        per_expert: list[list[int]] = []
        payload_bad: list[int] = []
        unreadable: list[str] = []
        for call in range(replays + 1):
            d = backend.dispatch(inp.x, inp.topk_idx, inp.topk_weights)
            sync(rt)
            rows.append(rows_of(d))
            counts = safely(
                unreadable,
                f"call {call} per-expert counts",
                lambda d=d: [int(c) for c in d.num_recv_per_expert],
                fallback=[],
            )
            per_expert.append(counts)
            found: list[str] = []
            check = safely(
                found,
                f"call {call}",
                ref.check_dispatch,
                d,
                ctx.global_routing,
                ctx.expected,
                ctx.local,
                fallback=None,
            )
            if found or check is None or check.problems:
                payload_bad.append(call)
        want = int(ctx.expected.rows.numel())
        step.data = {
            "rows_per_call": rows,
            "expected_rows": want,
            "per_expert_per_call": per_expert,
            "calls_with_wrong_tokens": payload_bad,
        }
        problems = unreadable[:1]
        if len(set(rows)) > 1:
            problems.append(
                f"dispatch returned {rows[0]} rows first and {rows[1:]} on replay: the same "
                "routing gives different shapes (activation-checkpoint recompute would fail)"
            )
        elif rows[0] != want:
            problems.append(f"every call returned {rows[0]} rows, the routing needs {want}")
        if any(p != per_expert[0] for p in per_expert[1:]):
            problems.append("per-expert counts change between identical dispatches")
        elif per_expert[0] != ctx.expected.per_expert:
            problems.append("per-expert counts differ from the routing's on every call")
        if payload_bad and not problems:
            problems.append(
                f"identical dispatches deliver wrong tokens or payloads on calls {payload_bad} "
                f"of {replays + 1} (a race: data read before it landed?)"
            )
        if problems:
            raise StepFailed(
                Status.FAIL,
                "; ".join(problems),
                "dispatch is not deterministic for fixed routing; disable activation "
                "checkpointing around this backend's MoE layers or use another backend",
                step.data,
            )
        step.detail = (
            f"{replays + 1} dispatches: {rows[0]} rows each, tokens, payloads and per-expert "
            "counts identical"
        )
    return agree(rt, step, _summarize_replay)


def _summarize_replay(merged: Step, per_rank: list[Step]) -> None:
    if all("rows_per_call" in s.data for s in per_rank):
        merged.data["rows_per_call_per_rank"] = [s.data["rows_per_call"] for s in per_rank]
        if merged.status == Status.PASS:
            calls = len(per_rank[0].data["rows_per_call"])
            merged.detail = (
                f"{calls} identical dispatches on every rank, payloads bit-exact; rows/rank "
                f"{[s.data['rows_per_call'][0] for s in per_rank]}"
            )
