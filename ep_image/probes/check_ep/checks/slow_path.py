"""The backend beside the all-gather path it exists to beat: time per call and peak memory.

Why this module exists: a backend that silently takes a slow path (an all-gather fallback after
a missing capability) returns the right numbers and passes every check. What gives it away is
what training would feel: calls no faster than the fallback's, and a peak per call as large as
gathering every rank's tokens, memory that grows with the world size. The reference backend
(``adapters/torch_reference.py``) is that fallback; it is timed here on the backend's inputs,
the same way, with few calls, and the figures warn without failing the step.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from ep_image.probes._adapters.base import EPBackend
from ep_image.probes._adapters.torch_reference import TorchBackend
from ep_image.probes._ranks.runtime import Runtime
from ep_image.probes.check_ep import reference as ref
from ep_image.probes.check_ep.checks.call_memory import CallMemory
from ep_image.probes.check_ep.checks.context import CheckContext, expert_output_of
from ep_image.probes.check_ep.checks.timing import Timing, bench
from ep_image.probes.check_ep.options import Options

#: The reference path's calls: enough for a median, few enough to keep the probe's time.
REFERENCE_WARMUP = 1
REFERENCE_ITERS = 5

REFERENCE_ITSELF = "the torch reference is the all-gather path itself: not compared"
SLOW_PATH = "a slow path inside the backend (an all-gather fallback after a missing capability?)"
HINT = (
    "the numbers are right but the backend is no faster or holds as much as the all-gather "
    "fallback: check its build (a backend built without its kernels or NVSHMEM falls back), "
    "run its own test on this machine and compare, and report it with this JSON"
)


def is_reference(backend: EPBackend) -> bool:
    """Whether the backend is the reference itself (``--backend torch``), not a subclass."""
    return type(backend) is TorchBackend


def time_reference(
    rt: Runtime,
    ctx: CheckContext,
    options: Options,
    dispatch_wrong: Callable[[int, Any], Any],
    combine_wrong: Callable[[int, Any], Any],
) -> tuple[Timing, Timing]:
    """The reference path's dispatch and combine on the inputs the backend was timed on, timed
    the same way (``REFERENCE_ITERS`` calls at most, each output checked by the backend's own
    checks after its timing, as the backend's are: on the CPU a peer still checking delays the
    next collective), each with one untimed call's memory. Every rank calls this, so its
    collectives stay in step."""
    path = TorchBackend()
    path.create(rt.ep_group, ctx.shape)
    inp = ctx.inputs
    d = path.dispatch(inp.x, inp.topk_idx, inp.topk_weights)
    y = expert_output_of(ctx, d)
    warmup = min(options.warmup, REFERENCE_WARMUP)
    iters = min(options.iters, REFERENCE_ITERS)
    dispatch = bench(
        rt,
        lambda i: ref.scale_payload(inp.x, ref.call_factor(i)),
        lambda x: path.dispatch(x, inp.topk_idx, inp.topk_weights),
        warmup,
        iters,
        dispatch_wrong,
        memory=True,
    )
    combine = bench(
        rt,
        lambda i: y * ref.call_factor(i),
        lambda y_i: path.combine(y_i, d.handle),
        warmup,
        iters,
        combine_wrong,
        memory=True,
    )
    path.destroy()
    return dispatch, combine


def memory_figures(op: str, memory: CallMemory | None) -> dict[str, Any]:
    """One operation's measured call, as report fields."""
    if memory is None:
        return {}
    return {
        f"{op}_peak_bytes": memory.peak,
        f"{op}_returned_bytes": memory.returned,
        f"{op}_beyond_output_bytes": memory.beyond_output,
    }


def rank_figures(
    rt: Runtime,
    ctx: CheckContext,
    payload: int,
    dispatch: Timing,
    combine: Timing,
    reference: tuple[Timing, Timing] | None,
) -> dict[str, Any]:
    """This rank's slow-path figures: payload, what gathering every rank's tokens takes, each
    operation's peak, and the reference path's times and peaks (None: the backend is it)."""
    shape = ctx.shape
    element = ctx.inputs.x.element_size()
    out: dict[str, Any] = {
        "payload_bytes": payload,
        "gather_bytes": rt.env.world * shape.tokens * shape.hidden * element,
        "memory_measured_by": (dispatch.memory or combine.memory or _unmeasured()).how,
        **memory_figures("dispatch", dispatch.memory),
        **memory_figures("combine", combine.memory),
        "reference": None,
    }
    if reference is not None:
        rd, rc = reference
        out["reference"] = {
            "dispatch_seconds": rd.seconds,
            "combine_seconds": rc.seconds,
            "timed_calls": rd.timed,
            **memory_figures("dispatch", rd.memory),
            **memory_figures("combine", rc.memory),
        }
    return out


def _unmeasured() -> CallMemory:
    return CallMemory(0, 0, "not measured")


def summarize(datas: list[dict[str, Any]], shared: bool) -> dict[str, Any]:
    """The slow-path figures over the ranks and their warnings.

    Speed: the ranks' mean time per call of each operation against the reference path's (a
    warning when the backend is no faster: speed-up <= 1; not applied on a shared GPU, whose
    time-slicing is no link's, nor at one rank, where the reference path crosses no link).
    Memory: the worst rank's peak per call against its payload, with a warning where a call's
    peak beyond what it returns is as large as gathering every rank's tokens while that rank
    receives less: memory that grows with the world size. The reference itself is not judged.
    """
    world = len(datas)
    first = datas[0]
    summary: dict[str, Any] = {
        "payload_bytes": max(d["payload_bytes"] for d in datas),
        "gather_bytes": first["gather_bytes"],
        "memory_measured_by": first["memory_measured_by"],
        "reference_itself": first["reference"] is None,
    }
    warnings: list[str] = []
    for op in ("dispatch", "combine"):
        peaks = [d.get(f"{op}_peak_bytes") for d in datas]
        if all(isinstance(p, int) for p in peaks):
            summary[f"{op}_peak_bytes"] = max(peaks)
            summary[f"{op}_peak_vs_payload"] = max(
                d[f"{op}_peak_bytes"] / d["payload_bytes"] if d["payload_bytes"] else 0.0
                for d in datas
            )
            held = [
                r
                for r, d in enumerate(datas)
                if d[f"{op}_beyond_output_bytes"] >= d["gather_bytes"] > d["payload_bytes"]
            ]
            if held and first["reference"] is not None:
                d = datas[held[0]]
                ranks = f"rank {held[0]}" + (f" and {len(held) - 1} more" if len(held) > 1 else "")
                warnings.append(
                    f"{op} held {_size(d[f'{op}_beyond_output_bytes'])} beyond its output "
                    f"({ranks}), as much as gathering every rank's tokens "
                    f"({_size(d['gather_bytes'])}) where the rank receives "
                    f"{_size(d['payload_bytes'])}: memory that grows with the world size"
                )
    if first["reference"] is not None:
        for op in ("dispatch", "combine"):
            mine = statistics.fmean(d[f"{op}_seconds"] for d in datas)
            theirs = statistics.fmean(d["reference"][f"{op}_seconds"] for d in datas)
            speedup = theirs / mine if mine > 0 else None
            summary[f"{op}_seconds_reference"] = theirs
            summary[f"{op}_speedup_vs_reference"] = speedup
            if speedup is not None and speedup <= 1.0 and not shared and world > 1:
                warnings.append(
                    f"{op} no faster than the all-gather reference path ({speedup:.2f}x its "
                    f"speed: {mine * 1e3:.3g} ms a call against {theirs * 1e3:.3g} ms)"
                )
        if shared or world == 1:
            summary["speed_warning"] = "not applied: " + (
                "ranks share a GPU" if shared else "one rank crosses no link"
            )
    summary["warnings"] = warnings
    return summary


def detail(summary: dict[str, Any]) -> str:
    """The figures and warnings, for the bandwidth step's table line."""
    parts = []
    if "dispatch_peak_bytes" in summary and "combine_peak_bytes" in summary:
        parts.append(
            f"peak per call: dispatch {_size(summary['dispatch_peak_bytes'])} "
            f"({summary['dispatch_peak_vs_payload']:.2g}x the payload), combine "
            f"{_size(summary['combine_peak_bytes'])} ({summary['combine_peak_vs_payload']:.2g}x)"
        )
    if summary["reference_itself"]:
        parts.append(REFERENCE_ITSELF)
    elif summary.get("dispatch_speedup_vs_reference") and summary.get(
        "combine_speedup_vs_reference"
    ):
        text = (
            f"dispatch {summary['dispatch_speedup_vs_reference']:.2f}x and combine "
            f"{summary['combine_speedup_vs_reference']:.2f}x the all-gather reference path's "
            "speed"
        )
        if "speed_warning" in summary:
            text += f" (speed warning {summary['speed_warning']})"
        parts.append(text)
    parts += [f"warning: {w}" for w in summary["warnings"]]
    if summary["warnings"]:
        parts.append(SLOW_PATH)
    return "; ".join(parts)


def _size(n: float) -> str:
    """Bytes in B, KiB or MiB, for the table."""
    if n >= 1 << 20:
        return f"{n / (1 << 20):.3g} MiB"
    if n >= 1024:
        return f"{n / 1024:.0f} KiB"
    return f"{n:.0f} B"
