"""The ``precision`` step: random tokens and router-like weights against an fp32 reference, at
DeepEP's bounds.

Why this module exists: the other steps' inputs make every right answer exact in bf16, so they
compare bit for bit, and a backend whose arithmetic is right only for such values passes them:
one that accumulates a token's contributions in bf16 instead of fp32, or carries the top-k
weights in bf16. Here the payload is random, the weights are a softmax, and each token's expert
outputs carry offsets that cancel in its sum (``reference/precision.py``); the bounds are
DeepEP's own: calc_diff < 5e-6 for combined tokens, < 1e-9 for top-k weights. Where no token
reaches three ranks of one node (two ranks), no input can show a running sum kept in bf16 (a sum
of two rows is rounded once either way): the step says so and names the run that can.
"""

from __future__ import annotations

from typing import Any

from ep_image.probes._adapters.base import EPBackend
from ep_image.probes._ranks.runtime import Runtime, agree, sync
from ep_image.probes._report import Status, Step, StepFailed, timed_step
from ep_image.probes.check_ep import reference as ref
from ep_image.probes.check_ep.checks.context import CheckContext, rows_of, safely, zero_rows
from ep_image.probes.check_ep.options import Options
from ep_image.probes.check_ep.reference.precision import ranks_reached

HINT = (
    "the backend is right for exact inputs only: a sum kept in the tokens' dtype instead of "
    "fp32, or weights or tokens carried at a lower precision; compare with --backend torch and "
    "report it with this JSON"
)

#: The run that checks accumulation precision on one GPU: a token must reach three ranks.
THREE_RANKS_ON_ONE_GPU = "--nproc-per-node 4 --ranks-per-gpu 4"


def step_precision(rt: Runtime, backend: EPBackend, ctx: CheckContext, options: Options) -> Step:
    """Dispatch random tokens, then combine the stand-in experts' outputs twice (plain, and
    with cancelling offsets), take dispatch_backward of the latter and combine_backward of a
    random gradient; each against its fp32 reference."""
    import torch

    with timed_step("precision") as step:
        shape, rank, local = ctx.shape, rt.env.rank, ctx.local
        nodes = rt.node_of_rank or [0] * rt.env.world
        seed = ref.mix_seed(options.seed, 1)
        inp = ref.make_random_inputs(shape, rank, seed)
        g = ref.gather_global(inp, rt.ep_group)
        exp = ref.expected_for_rank(g, rank, local)
        grad = ref.random_grad(shape, rank, seed)
        grad_global = ref.gather_uneven(grad, g.counts, rt.ep_group)
        d = backend.dispatch(inp.x, inp.topk_idx, inp.topk_weights)
        sync(rt)
        problems: list[str] = []
        rows = rows_of(d)
        handle = getattr(d, "handle", None)
        problems += safely(
            problems,
            "dispatch",
            ref.dispatch_contract,
            d,
            inp.x,
            shape.topk,
            local,
            fallback=[],
        )
        check = safely(
            problems,
            "dispatch",
            ref.check_dispatch,
            d,
            g,
            exp,
            local,
            ref.WEIGHTS_BOUND,
            fallback=None,
        )
        if check is not None:
            problems += [f"dispatch: {p}" for p in check.problems]
        unread = torch.full((rows,), -1, dtype=torch.int64, device=shape.device)
        recv = getattr(d, "recv_x", None)
        ids = safely(problems, "dispatch", ref.decode_ids, recv, g, fallback=unread)

        def expert_rows(cancel: bool) -> Any:
            return safely(
                problems,
                "dispatch",
                _received_contribution,
                d,
                g,
                ids,
                rank,
                local,
                ctx.scales,
                nodes,
                cancel,
                fallback=zero_rows(ctx, rows),
            )

        y_plain, y_cancel = expert_rows(False), expert_rows(True)
        out_plain = backend.combine(y_plain, handle)
        sync(rt)
        out_cancel = backend.combine(y_cancel, handle)
        sync(rt)
        back = backend.dispatch_backward(y_cancel, handle)
        sync(rt)
        cb = backend.combine_backward(grad, handle)
        sync(rt)

        gids = g.offsets[rank] + torch.arange(shape.tokens, device=shape.device)
        want_plain = ref.expected_sum(inp, gids, local, ctx.scales, nodes, cancel=False)
        want_cancel = ref.expected_sum(inp, gids, local, ctx.scales, nodes, cancel=True)
        diffs: dict[str, float] = {}
        for name, out, want in (
            ("combine", out_plain, want_plain),
            ("combine with cancelling offsets", out_cancel, want_cancel),
            ("dispatch_backward with cancelling offsets", back, want_cancel),
        ):
            op = name.split()[0]
            found = ref.tensor_contract(
                op, out, shape.tokens, shape.hidden, shape.dtype, shape.device
            )
            diff = ref.calc_diff(out.float(), want) if not found else float("inf")
            diffs[name] = diff
            if found:
                problems += [f"{name}: {p}" for p in found]
            elif not diff <= ref.COMBINE_BOUND:
                problems.append(f"{name}: {_describe(out, want, diff)}")
        found = ref.tensor_contract(
            "combine_backward", cb, rows, shape.hidden, grad.dtype, grad.device
        )
        if not found:
            bad, first = ref.compare_rows(cb, grad_global[ids.clamp(min=0)])
            if bad:
                found.append(
                    f"{bad} of {rows} rows are not bit-identical to the random output gradient "
                    f"of their token (first: row {first})"
                )
        problems += [f"combine_backward: {p}" for p in found]
        most = ranks_reached(g.topk_idx, local, nodes)
        step.data = {
            "seed": seed,
            "ranks_a_token_reaches": most,
            "accumulation_checked": most >= 3 or shape.dtype.itemsize >= 4,
            "dtype": str(shape.dtype).replace("torch.", ""),
            "topk": shape.topk,
            "ranks_per_node": nodes.count(nodes[rank]),
            "combine_bound": ref.COMBINE_BOUND,
            "weights_bound": ref.WEIGHTS_BOUND,
            "calc_diff": diffs,
            "weights_calc_diff": _weights_diff(d, g, exp, local),
        }
        if problems:
            raise StepFailed(Status.FAIL, "; ".join(problems), HINT, step.data)
        step.detail = (
            f"calc_diff combine {diffs['combine']:.2g}, with cancelling offsets "
            f"{diffs['combine with cancelling offsets']:.2g}"
        )
    return agree(rt, step, _summarize_precision)


def _received_contribution(
    d: Any,
    g: Any,
    ids: Any,
    rank: int,
    local: int,
    scales: Any,
    nodes: list[int],
    cancel: bool,
) -> Any:
    """This rank's stand-in experts on the rows it received, from the reference routing of the
    token each row names (0 for a row that names none)."""
    safe = ids.clamp(min=0)
    out = ref.contribution(
        d.recv_x, g.topk_idx[safe], g.topk_weights[safe], ids, rank, local, scales, nodes, cancel
    )
    return out * (ids >= 0)[:, None].to(out.dtype)


def _weights_diff(d: Any, g: Any, exp: Any, local: int) -> float | None:
    """calc_diff of the received top-k weights against the sent ones, in the routing's dense
    layout (None when the rows are not the tokens routed here)."""
    import torch

    try:
        ids = ref.decode_ids(d.recv_x, g)
        order = ids.argsort()
        if not torch.equal(ids[order], exp.rows):
            return None
        _, weights = ref.dense_routing(
            d.recv_topk_idx[order].to(torch.int64), d.recv_topk_weights[order], local
        )
        return ref.calc_diff(weights, exp.weights)
    except Exception:
        return None


def _describe(out: Any, want: Any, diff: float) -> str:
    """calc_diff and where the worst token is, for a reduction past the bound."""
    c = ref.compare_tokens(out, want, 0.0)
    text = (
        f"calc_diff {diff:.3g} against the fp32 reference > {ref.COMBINE_BOUND:g} "
        f"(worst: token {c.worst_token}, relative difference {c.worst:.3g}"
    )
    if c.nonfinite:
        text += f"; {c.nonfinite} tokens hold NaN or inf, first token {c.first_nonfinite}"
    return text + ")"


def _summarize_precision(merged: Step, per_rank: list[Step]) -> None:
    """The worst calc_diff of each operation over the ranks."""
    lists = [s.data.get("calc_diff") for s in per_rank]
    if not all(isinstance(x, dict) for x in lists):
        return
    worst = {name: max(x[name] for x in lists) for name in lists[0]}
    weights = [s.data.get("weights_calc_diff") for s in per_rank]
    merged.data["max_calc_diff"] = worst
    merged.data["max_weights_calc_diff"] = (
        max(weights) if all(w is not None for w in weights) else None
    )
    if merged.status == Status.PASS:
        merged.detail = (
            "random tokens, softmax weights: dispatch bit-exact, top-k weights calc_diff "
            f"{merged.data['max_weights_calc_diff']:.2g} (<= {ref.WEIGHTS_BOUND:g}); calc_diff "
            f"combine {worst['combine']:.2g}, with cancelling offsets "
            f"{worst['combine with cancelling offsets']:.2g}, dispatch_backward "
            f"{worst['dispatch_backward with cancelling offsets']:.2g} (<= "
            f"{ref.COMBINE_BOUND:g}); combine_backward bit-exact"
        )
        if not merged.data.get("accumulation_checked", True):
            merged.detail += "; " + unchecked_accumulation(merged.data)


def unchecked_accumulation(data: dict[str, Any]) -> str:
    """Why a running sum kept in the tokens' 16-bit dtype went unseen, and the run that sees it.

    In DeepEP's layout a token's combine adds one row per rank that holds one of its experts;
    the sum of two rows is rounded once whether it is kept in bf16 or in fp32 (the same bits,
    whatever the values: docs/probes.md, "Precision"), so no input can tell the two apart
    until a token reaches three ranks of one node."""
    most = data.get("ranks_a_token_reaches", 0)
    fixes = []
    if data.get("ranks_per_node", 0) < 3:
        fixes.append(f"4 ranks (on one GPU: {THREE_RANKS_ON_ONE_GPU})")
    if data.get("topk", 0) < 3:
        fixes.append("--topk 3 or more")
    if not fixes:
        fixes.append("more tokens per rank (--tokens)")
    return (
        f"accumulation precision unchecked: no token reaches more than {most} ranks of one "
        f"node, and a sum of two {data.get('dtype', '16-bit')} rows is rounded once whether "
        "the backend keeps it in that dtype or in fp32 (the same bits for every input), so a "
        "running sum kept in the tokens' dtype cannot show before a token reaches 3 ranks; "
        f"it is checked with {' and '.join(fixes)}"
    )
