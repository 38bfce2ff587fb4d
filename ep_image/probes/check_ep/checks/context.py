"""What the kernel checks share: each rank's inputs and the expectations derived from them.

Why this module exists: the checks all judge the backend against one set of inputs and one
reference computed from every rank's inputs alone (``reference``), prepared once per run,
before the first dispatch; they word their verdicts alike; and they keep the ranks in step: a
check never raises on what a backend returned (``safely``), so every rank makes the same
backend calls and collectives in the same order whatever its own checks found.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ep_image.probes._adapters.base import Shape
from ep_image.probes._ranks.runtime import Runtime
from ep_image.probes.check_ep import reference as ref
from ep_image.probes.check_ep.options import Options

T = TypeVar("T")


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


def safely(problems: list[str], what: str, fn: Callable[..., T], *args: Any, fallback: T) -> T:
    """``fn(*args)``, a computation of the probe's on what the backend returned; an output so
    malformed that it raises is a problem recorded under ``what`` and ``fallback`` stands in,
    so this rank goes on to the same next call as its peers (a rank that raised here would
    leave them blocked in that call's collective)."""
    try:
        return fn(*args)
    except Exception as exc:
        message = " ".join(str(exc).split())
        problems.append(f"{what}: could not be checked ({type(exc).__name__}: {message})")
        return fallback


def rows_of(d: Any) -> int:
    """Rows of what dispatch returned (0 when ``recv_x`` is not a [rows, hidden] tensor)."""
    import torch

    x = getattr(d, "recv_x", None)
    return int(x.shape[0]) if isinstance(x, torch.Tensor) and x.dim() == 2 else 0


def zero_rows(ctx: CheckContext, rows: int) -> Any:
    """A stand-in ``[rows, hidden]`` tensor of the layer's dtype, for a call whose real input
    could not be computed from a malformed output."""
    import torch

    return torch.zeros((rows, ctx.shape.hidden), dtype=ctx.shape.dtype, device=ctx.shape.device)
