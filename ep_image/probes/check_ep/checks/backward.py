"""The ``backward`` step: the gradients of dispatch and combine, composed and each on its own.

Why this module exists: training learns from these gradients; an error in one backward
operation that the other undoes passes the composite gradient and still gives the experts
wrong weight gradients, so both are checked separately too.
"""

from __future__ import annotations

from typing import Any

from ep_image.probes._adapters.base import EPBackend
from ep_image.probes._ranks.runtime import Runtime, agree, sync
from ep_image.probes._report import Status, Step, StepFailed, timed_step
from ep_image.probes.check_ep import reference as ref
from ep_image.probes.check_ep.checks.context import (
    CheckContext,
    bound_text,
    rows_of,
    safely,
    zero_rows,
)


def _autograd_functions(problems: list[str]) -> tuple[Any, Any]:
    """Dispatch and combine as autograd functions, built on the backend's own backward hooks.

    Each returns a tensor of the shape autograd expects whatever the backend gave (a wrong one
    is recorded in ``problems`` and zeros stand in): autograd refusing a malformed gradient
    would end this rank's step between two backend calls its peers make.
    """
    import torch

    def well_formed(what: str, got: Any, like: tuple[Any, ...]) -> torch.Tensor:
        """``got`` if autograd can take it as a tensor of ``like`` (shape, dtype, device)."""
        shape, dtype, device = like
        if (
            isinstance(got, torch.Tensor)
            and tuple(got.shape) == shape
            and got.is_floating_point()
            and got.device == device
        ):
            return got
        found = list(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        problems.append(f"{what} returned {found} where {list(shape)} was expected")
        return torch.zeros(shape, dtype=dtype, device=device)

    def spec(t: torch.Tensor) -> tuple[Any, ...]:
        return tuple(t.shape), t.dtype, t.device

    class DispatchFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, backend, topk_idx, topk_weights, box):  # type: ignore[override]
            d = backend.dispatch(x, topk_idx, topk_weights)
            box.append(d)
            ctx.backend, ctx.handle = backend, getattr(d, "handle", None)
            ctx.x_like = spec(x)
            recv = getattr(d, "recv_x", None)
            if isinstance(recv, torch.Tensor) and recv.dim() == 2 and recv.shape[1] == x.shape[1]:
                return recv.detach()
            return x.new_zeros((0, x.shape[1]))

        @staticmethod
        def backward(ctx, grad):  # type: ignore[override]
            grad_x = ctx.backend.dispatch_backward(grad.contiguous(), ctx.handle)
            return well_formed("dispatch_backward", grad_x, ctx.x_like), None, None, None, None

    class CombineFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y, backend, handle, tokens):  # type: ignore[override]
            ctx.backend, ctx.handle, ctx.y_like = backend, handle, spec(y)
            out = backend.combine(y, handle)
            shape = (tokens, y.shape[1])
            same = isinstance(out, torch.Tensor) and tuple(out.shape) == shape
            if same and out.device == y.device:
                return out.detach() if out.is_floating_point() else out.float()
            return well_formed("combine", out, (shape, y.dtype, y.device))

        @staticmethod
        def backward(ctx, grad):  # type: ignore[override]
            grad_y = ctx.backend.combine_backward(grad.contiguous(), ctx.handle)
            return well_formed("combine_backward", grad_y, ctx.y_like), None, None, None

    return DispatchFn, CombineFn


def step_backward(rt: Runtime, backend: EPBackend, ctx: CheckContext, seed: int) -> Step:
    """Gradient of sum(combine(expert(dispatch(x))) * g) w.r.t. x versus g * sum_k w_k s_k,
    then each backward operation on its own (an error in one that the other undoes still
    gives the experts wrong weight gradients)."""
    import torch

    problems: list[str] = []
    dispatch_fn, combine_fn = _autograd_functions(problems)
    with timed_step("backward") as step:
        inp, shape = ctx.inputs, ctx.shape
        mask = ref.id_mask(shape.hidden, shape.device)
        x = inp.x.detach().clone().requires_grad_(True)
        box: list[Any] = []
        recv = dispatch_fn.apply(x, backend, inp.topk_idx, inp.topk_weights, box)
        d = box[0]
        rows = int(recv.shape[0])
        factor = safely(
            problems,
            "dispatch",
            lambda: ref.row_factor(ctx.expected, ref.decode_ids(recv, ctx.global_routing)),
            fallback=torch.zeros(rows, device=shape.device),
        )
        y = (recv.float() * factor[:, None] * mask).to(recv.dtype)
        out = combine_fn.apply(y, backend, getattr(d, "handle", None), shape.tokens)
        g = ref.output_grad(shape, shape.tokens, seed, rt.env.rank)
        (out.float() * g.float()).sum().backward()
        sync(rt)
        scale = ref.token_scale(inp, ctx.scales)
        expected = g.float() * scale[:, None] * mask
        composite = ref.compare_tokens(x.grad, expected, ctx.tolerance)
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
    import torch

    inp, shape, g = ctx.inputs, ctx.shape, ctx.global_routing
    d = backend.dispatch(inp.x, inp.topk_idx, inp.topk_weights)
    sync(rt)
    problems: list[str] = []
    rows = rows_of(d)
    unread = torch.full((rows,), -1, dtype=torch.int64, device=shape.device)
    recv = getattr(d, "recv_x", None)
    ids = safely(problems, "dispatch", ref.decode_ids, recv, g, fallback=unread)
    handle = getattr(d, "handle", None)
    grad = ref.output_grad(shape, shape.tokens, seed, rt.env.rank, salt=104729)
    grad_global = ref.gather_uneven(grad, g.counts, rt.ep_group)
    want_rows = grad_global[ids.clamp(min=0)]
    cb = backend.combine_backward(grad, handle)
    sync(rt)
    h = safely(
        problems,
        "dispatch",
        lambda: ref.expert_output(want_rows, ref.row_factor(ctx.expected, ids)),
        fallback=zero_rows(ctx, rows),
    )
    db = backend.dispatch_backward(h, handle)
    sync(rt)
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
