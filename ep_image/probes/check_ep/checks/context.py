"""What the kernel checks share: each rank's inputs and the expectations derived from them.

Why this module exists: the checks all judge the backend against one set of inputs and one
reference computed from every rank's inputs alone (``reference``), prepared once per run,
before the first dispatch; and they word their verdicts alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ep_image.probes.check_ep import reference as ref
from ep_image.probes.check_ep.ranks import Runtime
from ep_image.probes.check_ep.types import Options, Shape


@dataclass
class CheckContext:
    """Inputs and independent expectations shared by the check steps."""

    shape: Shape
    local: int
    inputs: Any
    global_routing: Any
    expected: Any
    scales: Any
    tolerance: float
    expected_combine: Any  # [tokens, hidden] float32


def prepare_checks(rt: Runtime, shape: Shape, options: Options) -> CheckContext:
    inputs = ref.make_inputs(shape, rt.env.rank, options.seed)
    g = ref.gather_global(inputs, rt.ep_group)
    local = shape.local_experts(rt.env.world)
    tol = options.tolerance
    if tol is None:
        tol = ref.tolerance_for(shape.dtype, shape.topk)
    scales = ref.expert_scales(shape.experts, shape.device)
    expected = ref.expected_for_rank(g, rt.env.rank, local, scales)
    return CheckContext(
        shape=shape,
        local=local,
        inputs=inputs,
        global_routing=g,
        expected=expected,
        scales=scales,
        tolerance=tol,
        expected_combine=ref.expected_combine(inputs, scales),
    )


def bound_text(diff: float, tolerance: float) -> str:
    """How close every token came: exact, or its worst difference within the bound."""
    if tolerance == 0:
        return "every token exactly equal to the reference"
    return f"max per-token rel diff {diff:.2g} <= {tolerance:g}"


def dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def expert_output_of(ctx: CheckContext, d: Any) -> Any:
    """The stand-in experts applied to received rows: each row times the weighted scales of
    the token it names (from the reference routing), identity columns 0."""
    ids = ref.decode_ids(d.recv_x, ctx.global_routing)
    return ref.expert_output(d.recv_x, ref.row_factor(ctx.expected, ids))
