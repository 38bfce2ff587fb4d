"""The ``backward`` step: the gradients of dispatch and combine, composed and each on its own.

Why this module exists: training learns from these gradients; an error in one backward
operation that the other undoes passes the composite gradient and still gives the experts
wrong weight gradients, so both are checked separately too.
"""

from __future__ import annotations

from typing import Any

from ep_image.probes._report import Status, Step, StepFailed, timed_step
from ep_image.probes.check_ep import reference as ref
from ep_image.probes.check_ep.adapters.base import EPBackend
from ep_image.probes.check_ep.checks.context import CheckContext, bound_text
from ep_image.probes.check_ep.ranks import Runtime, agree, sync


def _autograd_functions() -> tuple[Any, Any]:
    """Dispatch and combine as autograd functions, built on the backend's own backward hooks."""
    import torch

    class DispatchFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, backend, topk_idx, topk_weights, box):  # type: ignore[override]
            d = backend.dispatch(x, topk_idx, topk_weights)
            box.append(d)
            ctx.backend, ctx.handle = backend, d.handle
            return d.recv_x

        @staticmethod
        def backward(ctx, grad):  # type: ignore[override]
            grad_x = ctx.backend.dispatch_backward(grad.contiguous(), ctx.handle)
            return grad_x, None, None, None, None

    class CombineFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y, backend, handle):  # type: ignore[override]
            ctx.backend, ctx.handle = backend, handle
            return backend.combine(y, handle)

        @staticmethod
        def backward(ctx, grad):  # type: ignore[override]
            return ctx.backend.combine_backward(grad.contiguous(), ctx.handle), None, None

    return DispatchFn, CombineFn


def step_backward(rt: Runtime, backend: EPBackend, ctx: CheckContext, seed: int) -> Step:
    """Gradient of sum(combine(expert(dispatch(x))) * g) w.r.t. x versus g * sum_k w_k s_k,
    then each backward operation on its own (an error in one that the other undoes still
    gives the experts wrong weight gradients)."""
    dispatch_fn, combine_fn = _autograd_functions()
    with timed_step("backward") as step:
        inp, shape = ctx.inputs, ctx.shape
        mask = ref.id_mask(shape.hidden, shape.device)
        x = inp.x.detach().clone().requires_grad_(True)
        box: list[Any] = []
        recv = dispatch_fn.apply(x, backend, inp.topk_idx, inp.topk_weights, box)
        d = box[0]
        factor = ref.row_factor(ctx.expected, ref.decode_ids(d.recv_x, ctx.global_routing))
        y = (recv.float() * factor[:, None] * mask).to(recv.dtype)
        out = combine_fn.apply(y, backend, d.handle)
        g = ref.output_grad(shape, shape.tokens, seed, rt.env.rank)
        (out.float() * g.float()).sum().backward()
        sync(rt)
        scale = ref.token_scale(inp, ctx.scales)
        expected = g.float() * scale[:, None] * mask
        composite = ref.compare_tokens(x.grad, expected, ctx.tolerance)
        problems = []
        if not composite.ok:
            problems.append(
                "d/dx sum(combine(dispatch(x)) * g): "
                + ref.describe_tokens(composite, "g * sum_k w_k * scale_k", ctx.tolerance)
            )
        separate = _backward_ops(rt, backend, ctx, seed)
        problems += separate
        step.data = {
            "grad_rel_diff": composite.worst,
            "worst_token": composite.worst_token,
            "tokens_over_tolerance": composite.over,
            "tolerance": ctx.tolerance,
            "operations_checked": ["composite", "combine_backward", "dispatch_backward"],
        }
        if problems:
            detail = "; ".join(problems)
            if composite.ok and any(p.startswith("combine_backward") for p in separate):
                detail += (
                    "; the composite d/dx matches (the other operation undoes the error), but "
                    "the experts' weight gradients come from combine_backward"
                )
            raise StepFailed(
                Status.FAIL,
                detail,
                "the backward of dispatch (a combine) or of combine (a cached dispatch) is "
                "wrong; training with this backend would learn from wrong gradients",
                step.data,
            )
        step.detail = f"grad rel diff {composite.worst:.2g}"
    return agree(rt, step, _summarize_backward)


def _backward_ops(rt: Runtime, backend: EPBackend, ctx: CheckContext, seed: int) -> list[str]:
    """combine_backward and dispatch_backward alone, through a new dispatch of the routing."""
    inp, shape, g = ctx.inputs, ctx.shape, ctx.global_routing
    d = backend.dispatch(inp.x, inp.topk_idx, inp.topk_weights)
    sync(rt)
    ids = ref.decode_ids(d.recv_x, g)
    rows = int(d.recv_x.shape[0])
    grad = ref.output_grad(shape, shape.tokens, seed, rt.env.rank, salt=104729)
    grad_global = ref.gather_uneven(grad, g.counts, rt.ep_group)
    want_rows = grad_global[ids.clamp(min=0)]
    cb = backend.combine_backward(grad, d.handle)
    sync(rt)
    h = ref.expert_output(want_rows, ref.row_factor(ctx.expected, ids))
    db = backend.dispatch_backward(h, d.handle)
    sync(rt)
    problems = []
    found = ref.tensor_contract("combine_backward", cb, rows, shape.hidden, grad.dtype, grad.device)
    if not found:
        bad, first = ref.compare_rows(cb, want_rows)
        if bad:
            token = int(ids[first])
            name = ref.name_row(g, token) if token >= 0 else "a row naming no token"
            found.append(
                f"{bad} of {rows} rows differ from the output gradient of their token "
                f"(first: row {first}, {name})"
            )
    problems += [f"combine_backward (the gradient the experts get): {p}" for p in found]
    want = grad.float() * ref.token_scale(inp, ctx.scales)[:, None]
    want = want * ref.id_mask(shape.hidden, grad.device)
    found = ref.tensor_contract(
        "dispatch_backward", db, shape.tokens, shape.hidden, h.dtype, h.device
    )
    c = ref.compare_tokens(db, want, ctx.tolerance)
    if not c.ok:
        found.append(ref.describe_tokens(c, "the sum of its rows' gradients", ctx.tolerance))
    problems += [f"dispatch_backward (the gradient the tokens get): {p}" for p in found]
    return problems


def _summarize_backward(merged: Step, per_rank: list[Step]) -> None:
    diffs = [s.data.get("grad_rel_diff") for s in per_rank]
    if all(d is not None for d in diffs):
        merged.data["max_grad_rel_diff"] = max(diffs)
        if merged.status == Status.PASS:
            merged.detail = (
                "d/dx sum(combine(dispatch(x)) * g) matches the analytic gradient, and "
                "combine_backward and dispatch_backward each on their own; "
                + bound_text(max(diffs), per_rank[0].data["tolerance"])
            )
