"""The ``bandwidth`` step: GB/s of dispatch and combine beside a device copy, every call's output
checked; each call's peak memory and its time against the all-gather reference path.

Why this module exists: a fast backend is the point of one, but a time is a bandwidth only when
the data is right: every timed call gets new activations and is checked after its timing ends,
so an answer served from a cache, or a race between back-to-back calls, fails instead of
measuring. And right data at a fallback's speed and memory is a slow path a user must hear of
(``slow_path``): a warning, not a failure.
"""

from __future__ import annotations

import statistics
from typing import Any

from ep_image.probes._adapters.base import EPBackend
from ep_image.probes._ranks.runtime import ONE_RANK_LABEL, SHARED_GPU_LABEL, Runtime, agree
from ep_image.probes._report import Status, Step, StepFailed, timed_step
from ep_image.probes.check_ep import reference as ref
from ep_image.probes.check_ep.checks import slow_path
from ep_image.probes.check_ep.checks.context import (
    CheckContext,
    expert_output_of,
    rows_of,
    safely,
    zero_rows,
)
from ep_image.probes.check_ep.checks.timing import bench
from ep_image.probes.check_ep.options import Options


def step_bandwidth(rt: Runtime, backend: EPBackend, ctx: CheckContext, options: Options) -> Step:
    """GB/s of dispatch and combine (received bytes / median time) and of a device copy.

    Every call gets new activations (the same tokens' payload times a power of two that
    changes from call to call, prepared before its timing starts), so no backend can answer
    from a cache, and every output is checked after its timing ends: dispatch for the tokens
    routed here, bit-exact, combine token by token against the reference.

    One untimed call of each is measured for its peak memory, and (unless the backend is the
    reference itself) the reference path is timed on the same inputs: ``slow_path``.
    """
    import torch

    with timed_step("bandwidth") as step:
        inp = ctx.inputs
        d = backend.dispatch(inp.x, inp.topk_idx, inp.topk_weights)
        rows = rows_of(d)
        unreadable: list[str] = []
        y = safely(unreadable, "dispatch", expert_output_of, ctx, d, fallback=zero_rows(ctx, rows))
        element = torch.tensor([], dtype=ctx.shape.dtype).element_size()
        nbytes = rows * ctx.shape.hidden * element
        handle = getattr(d, "handle", None)

        def dispatch_wrong(i: int, out: Any) -> Any:
            f = ref.call_factor(i)
            return ref.dispatch_wrong(out.recv_x, ctx.global_routing, ctx.expected, f)

        def combine_wrong(i: int, out: Any) -> Any:
            want = ctx.expected_combine * ref.call_factor(i)
            if not isinstance(out, torch.Tensor) or out.shape != want.shape:
                return torch.ones((), dtype=torch.bool, device=want.device)
            return (ref.per_token_rel_diff(out.float(), want) > ctx.tolerance).any()

        dispatch = bench(
            rt,
            lambda i: ref.scale_payload(inp.x, ref.call_factor(i)),
            lambda x: backend.dispatch(x, inp.topk_idx, inp.topk_weights),
            options.warmup,
            options.iters,
            dispatch_wrong,
            memory=True,
            label="timed dispatch",
        )
        combine = bench(
            rt,
            lambda i: y * ref.call_factor(i),
            lambda y_i: backend.combine(y_i, handle),
            options.warmup,
            options.iters,
            combine_wrong,
            memory=True,
            label="timed combine",
        )
        t_dispatch, bad_dispatch = dispatch.seconds, dispatch.bad
        t_combine, bad_combine = combine.seconds, combine.bad
        # On every rank, whatever this rank's checks found: the reference's collectives.
        reference = None
        if not slow_path.is_reference(backend):
            reference = slow_path.time_reference(rt, ctx, options, dispatch_wrong, combine_wrong)
        src = torch.empty(max(nbytes // element, 1), dtype=ctx.shape.dtype, device=rt.device)
        dst = torch.empty_like(src)
        t_copy = bench(
            rt,
            lambda i: None,
            lambda _: dst.copy_(src),
            options.warmup,
            options.iters,
            None,
            collective=False,
        ).seconds
        copy_bytes = src.numel() * src.element_size()
        shared = rt.placement.shared
        data: dict[str, Any] = {
            "bytes": nbytes,
            "dispatch_seconds": t_dispatch,
            "combine_seconds": t_combine,
            "copy_seconds": t_copy,
            "dispatch_gbs": nbytes / t_dispatch / 1e9 if t_dispatch > 0 else 0.0,
            "combine_gbs": nbytes / t_combine / 1e9 if t_combine > 0 else 0.0,
            "copy_gbs": copy_bytes / t_copy / 1e9 if t_copy > 0 else 0.0,
            "timer": "cuda events" if rt.use_gpu else "perf_counter",
            "checked_calls": dispatch.calls,
            "shared_gpu": shared,
            "link_figure": rt.use_gpu and not shared and rt.env.world > 1,
            **slow_path.rank_figures(rt, ctx, nbytes, dispatch, combine, reference),
        }
        if shared:
            data["note"] = SHARED_GPU_LABEL
        elif rt.env.world == 1:
            data["note"] = ONE_RANK_LABEL
        if len(set(rt.node_of_rank)) > 1:
            split = (rt, d.recv_x, nbytes, t_dispatch, t_combine)
            data.update(safely(unreadable, "dispatch", _link_split, *split, fallback={}))
        step.data = data
        data["dispatch_vs_copy"] = data["dispatch_gbs"] / data["copy_gbs"] if t_copy else None
        data["combine_vs_copy"] = data["combine_gbs"] / data["copy_gbs"] if t_copy else None
        calls = dispatch.calls
        wrong = unreadable[:1] + [
            f"{len(bad)} of {calls} back-to-back {op} calls returned wrong data (calls {bad})"
            for op, bad in (("dispatch", bad_dispatch), ("combine", bad_combine))
            if bad
        ]
        if wrong:
            data["wrong_calls"] = {"dispatch": bad_dispatch, "combine": bad_combine}
            raise StepFailed(
                Status.FAIL,
                "; ".join(wrong) + " (each call had new activations: a result served from "
                "an earlier call is wrong, and its time is not a bandwidth)",
                "where only later calls are wrong, results change when calls follow each "
                "other quickly (a race: data read before it landed) or come from a cache; do "
                "not train with this backend and report it with this JSON",
                data,
            )
        slow = [
            f"{op} {data[op + '_gbs']:.3g} GB/s"
            for op in ("dispatch", "combine")
            if data[op + "_gbs"] < options.min_gbs
        ]
        if slow and not shared:
            raise StepFailed(
                Status.FAIL,
                f"{', '.join(slow)} below --min-gbs {options.min_gbs:g}",
                "check NVLink topology (nvidia-smi topo -m), SM/QP settings and that no other "
                "job shares the GPUs",
                data,
            )
        step.detail = (
            f"dispatch {data['dispatch_gbs']:.3g} GB/s, combine {data['combine_gbs']:.3g} GB/s, "
            f"copy {data['copy_gbs']:.3g} GB/s"
        )
        if shared:
            step.detail = f"{SHARED_GPU_LABEL}: {step.detail}; --min-gbs not applied"
        elif rt.env.world == 1:
            step.detail = f"{ONE_RANK_LABEL}: {step.detail}"
    return agree(rt, step, _summarize_bandwidth)


def _link_split(
    rt: Runtime, recv_x: Any, nbytes: int, t_dispatch: float, t_combine: float
) -> dict[str, Any]:
    """Received bytes from this node's ranks (NVLink) and from other nodes (RDMA), as DeepEP's
    internode test reports them; each over the same call time."""
    import torch

    nodes = torch.tensor(rt.node_of_rank, device=recv_x.device)
    src = recv_x[:, 0].float().round().long().clamp(0, len(rt.node_of_rank) - 1)
    rows = int(recv_x.shape[0])
    remote = int((nodes[src] != rt.node_of_rank[rt.env.rank]).sum()) if rows else 0
    rdma_bytes = nbytes * remote // rows if rows else 0
    nvl_bytes = nbytes - rdma_bytes
    out: dict[str, Any] = {"nvl_bytes": nvl_bytes, "rdma_bytes": rdma_bytes}
    for op, seconds in (("dispatch", t_dispatch), ("combine", t_combine)):
        out[f"{op}_nvl_gbs"] = nvl_bytes / seconds / 1e9 if seconds > 0 else 0.0
        out[f"{op}_rdma_gbs"] = rdma_bytes / seconds / 1e9 if seconds > 0 else 0.0
    return out


def _summarize_bandwidth(merged: Step, per_rank: list[Step]) -> None:
    datas = [s.data for s in per_rank]
    if not all("dispatch_gbs" in d for d in datas):
        return
    summary: dict[str, Any] = {}
    split = ("dispatch_nvl_gbs", "dispatch_rdma_gbs", "combine_nvl_gbs", "combine_rdma_gbs")
    keys = ("dispatch_gbs", "combine_gbs", "copy_gbs")
    for key in (*keys, *(k for k in split if all(k in d for d in datas))):
        values = [d[key] for d in datas]
        summary[key] = {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}
    copy = summary["copy_gbs"]["mean"]
    summary["dispatch_vs_copy"] = summary["dispatch_gbs"]["mean"] / copy if copy else None
    summary["combine_vs_copy"] = summary["combine_gbs"]["mean"] / copy if copy else None
    merged.data.update(summary)
    slow = None
    if all("payload_bytes" in d for d in datas):
        slow = slow_path.summarize(datas, bool(datas[0].get("shared_gpu")))
        merged.data["slow_path"] = slow
    if merged.status == Status.PASS:
        merged.detail = (
            f"dispatch {summary['dispatch_gbs']['mean']:.3g} GB/s, combine "
            f"{summary['combine_gbs']['mean']:.3g} GB/s (mean of ranks); device copy "
            f"{copy:.3g} GB/s"
        )
        if summary["dispatch_vs_copy"] is not None:
            merged.detail += f"; dispatch/copy {summary['dispatch_vs_copy']:.2g}"
        if "dispatch_rdma_gbs" in summary:
            merged.detail += (
                f"; dispatch NVLink {summary['dispatch_nvl_gbs']['mean']:.3g} + RDMA "
                f"{summary['dispatch_rdma_gbs']['mean']:.3g} GB/s"
            )
        if slow is not None:
            merged.detail += "; " + slow_path.detail(slow)
            merged.hint = slow_path.HINT if slow["warnings"] else ""
        if datas[0].get("shared_gpu"):
            merged.detail = f"{SHARED_GPU_LABEL}: {merged.detail}; --min-gbs not applied"
        elif len(datas) == 1:
            merged.detail = f"{ONE_RANK_LABEL}: {merged.detail}"
