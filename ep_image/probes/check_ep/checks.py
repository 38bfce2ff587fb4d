"""The checks of check_ep that run the backend's kernels: dispatch+combine, backward, replay,
scenarios, bandwidth.

Each compares every call's output (the timed ones too) token by token with what
``_ep_reference`` derives from the inputs alone; see docs/probes.md, section "Steps".
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ep_image.probes._report import Status, Step, StepFailed, timed_step
from ep_image.probes.check_ep.ranks import SHARED_GPU_LABEL, Runtime, agree

if TYPE_CHECKING:
    from ep_image.probes.check_ep.adapters import EPBackend, Shape


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


def prepare_checks(rt: Runtime, shape: Shape, args: argparse.Namespace) -> CheckContext:
    from ep_image.probes.check_ep import reference as ref

    inputs = ref.make_inputs(shape, rt.env.rank, args.seed)
    g = ref.gather_global(inputs, rt.ep_group)
    local = shape.local_experts(rt.env.world)
    tol = args.tolerance
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


def _bound_text(diff: float, tolerance: float) -> str:
    """How close every token came: exact, or its worst difference within the bound."""
    if tolerance == 0:
        return "every token exactly equal to the reference"
    return f"max per-token rel diff {diff:.2g} <= {tolerance:g}"


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def sync(rt: Runtime) -> None:
    if rt.use_gpu:
        import torch

        torch.cuda.synchronize(rt.device)


def _expert_output(rt: Runtime, ctx: CheckContext, d: Any) -> Any:
    """The stand-in experts applied to received rows: each row times the weighted scales of
    the token it names (from the reference routing), identity columns 0."""
    from ep_image.probes.check_ep import reference as ref

    ids = ref.decode_ids(d.recv_x, ctx.global_routing)
    return ref.expert_output(d.recv_x, ref.row_factor(ctx.expected, ids))


def step_dispatch_combine(rt: Runtime, backend: EPBackend, ctx: CheckContext) -> Step:
    """One dispatch and one combine, compared token by token with the reference."""
    from ep_image.probes.check_ep import reference as ref

    with timed_step("dispatch_combine") as step:
        inp = ctx.inputs
        d = backend.dispatch(inp.x, inp.topk_idx, inp.topk_weights)
        sync(rt)
        problems = ref.dispatch_contract(d, inp.x, ctx.shape.topk, ctx.local)
        check = ref.check_dispatch(d, ctx.global_routing, ctx.expected, ctx.local)
        y = _expert_output(rt, ctx, d)
        out = backend.combine(y, d.handle)
        sync(rt)
        problems += check.problems
        problems += ref.tensor_contract(
            "combine", out, ctx.shape.tokens, ctx.shape.hidden, y.dtype, y.device
        )
        c = ref.compare_tokens(out, ctx.expected_combine, ctx.tolerance)
        step.data = {
            "received": check.received,
            "expected": check.expected,
            "per_expert": check.per_expert,
            "expected_per_expert": check.expected_per_expert,
            "rel_diff": c.worst,
            "worst_token": c.worst_token,
            "tokens_over_tolerance": c.over,
            "tokens_not_finite": c.nonfinite,
            "global_rel_diff": ref.rel_diff(out.float(), ctx.expected_combine),
            "tolerance": ctx.tolerance,
        }
        if not c.ok:
            problems.append(
                "combine: "
                + ref.describe_tokens(c, "the top-k weighted sum", ctx.tolerance)
                + f", {_dtype_name(ctx.shape.dtype)}: combine does not return the top-k "
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
            + _bound_text(diff, datas[0]["tolerance"])
        )


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
    from ep_image.probes.check_ep import reference as ref

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
    from ep_image.probes.check_ep import reference as ref

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
                + _bound_text(max(diffs), per_rank[0].data["tolerance"])
            )


def step_replay(rt: Runtime, backend: EPBackend, ctx: CheckContext, replays: int) -> Step:
    """Dispatch the same routing again: rows, counts and every payload bit must not change."""
    from ep_image.probes.check_ep import reference as ref

    with timed_step("replay") as step:
        inp = ctx.inputs
        rows: list[int] = []
        per_expert: list[list[int]] = []
        payload_bad: list[int] = []
        for call in range(replays + 1):
            d = backend.dispatch(inp.x, inp.topk_idx, inp.topk_weights)
            sync(rt)
            rows.append(int(d.recv_x.shape[0]))
            per_expert.append([int(c) for c in d.num_recv_per_expert])
            check = ref.check_dispatch(d, ctx.global_routing, ctx.expected, ctx.local)
            if check.problems:
                payload_bad.append(call)
        want = int(ctx.expected.rows.numel())
        step.data = {
            "rows_per_call": rows,
            "expected_rows": want,
            "per_expert_per_call": per_expert,
            "calls_with_wrong_tokens": payload_bad,
        }
        problems = []
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


def step_scenarios(
    rt: Runtime, backend: EPBackend, ctx: CheckContext, args: argparse.Namespace
) -> Step:
    """The selected scenarios of ``_ep_scenarios``, each checked on every rank."""
    from ep_image.probes.check_ep import scenario_run
    from ep_image.probes.check_ep import scenarios as scen

    with timed_step("scenarios") as step:
        names = list(args.scenario_names)
        tokens = scen.scenario_tokens(ctx.shape.tokens)
        step.data = {
            "selected": names,
            "tokens_per_rank": tokens,
            "tolerance": ctx.tolerance,
            "seed": args.seed,
            "scenarios": [],
        }
        if not names:
            step.status = Status.INFO
            step.detail = "no scenario selected (--scenarios none)"
        else:
            results = scenario_run.run_all(rt, backend, ctx.shape, names, args.seed, ctx.tolerance)
            step.data["scenarios"] = results
            statuses = {r["status"] for r in results}
            bad = [r for r in results if r["status"] in (scen.FAIL, scen.ERROR)]
            step.detail = _scenarios_detail(results, tokens)
            if bad:
                raise StepFailed(
                    Status.ERROR if scen.ERROR in statuses else Status.FAIL,
                    step.detail,
                    SCENARIO_HINT,
                    step.data,
                )
    return agree(rt, step, _summarize_scenarios)


SCENARIO_HINT = (
    "the backend is wrong for inputs training presents (docs/probes.md, Scenarios): rerun "
    "one alone with --scenarios NAME and the same --seed to reproduce it, compare with "
    "--backend torch, and report it with this JSON"
)


def _scenarios_detail(results: list[dict[str, Any]], tokens: int) -> str:
    """One line: what failed first (with its rank), what passed, what does not apply."""
    from ep_image.probes.check_ep import scenarios as scen

    def names(status: str) -> list[str]:
        return [r["name"] for r in results if r["status"] == status]

    parts = []
    for r in results:
        if r["status"] in (scen.FAIL, scen.ERROR):
            where = f" on rank {r['rank']}" if r.get("rank") is not None else ""
            word = "failed" if r["status"] == scen.FAIL else "stopped"
            parts.append(f"{r['name']} {word}{where} (seed {r['seed']}): {r['detail']}")
    passed = names(scen.PASS)
    if passed:
        parts.append(
            f"{len(passed)} passed on every rank: {', '.join(passed)} ({tokens} tokens/rank)"
        )
    parts += [
        r["detail"].replace("not applicable", f"{r['name']} not applicable", 1)
        for r in results
        if r["status"] == scen.NOT_APPLICABLE
    ]
    if names(scen.NOT_RUN):
        parts.append(f"not run: {', '.join(names(scen.NOT_RUN))}")
    return "; ".join(parts)


def _summarize_scenarios(merged: Step, per_rank: list[Step]) -> None:
    """Each scenario merged over ranks: the worst status, the first bad rank's detail."""
    from ep_image.probes._report import one_line
    from ep_image.probes.check_ep import scenarios as scen

    lists = [s.data.get("scenarios") for s in per_rank]
    if not lists or any(not isinstance(x, list) for x in lists) or not lists[0]:
        return
    merged_results = []
    for i, first in enumerate(lists[0]):
        entries = [lst[i] for lst in lists if i < len(lst)]
        worst = max(entries, key=lambda e: scen.SEVERITY.get(e["status"], 0))
        out = {k: v for k, v in first.items() if k not in ("problems",)}
        out["status"] = worst["status"]
        out["detail"] = worst["detail"]
        if worst["status"] in (scen.FAIL, scen.ERROR):
            bad = [r for r, e in enumerate(entries) if e["status"] == worst["status"]]
            out["rank"] = bad[0]
            out["failed_ranks"] = bad
            out["problems"] = worst.get("problems", [])
        if "tokens" in first:
            out["tokens_per_rank"] = [e.get("tokens") for e in entries]
            out["received_per_rank"] = [e.get("received") for e in entries]
            out.pop("tokens", None)
            out.pop("received", None)
        merged_results.append(out)
    merged.data["scenarios"] = merged_results
    tokens = per_rank[0].data.get("tokens_per_rank", 0)
    merged.detail = one_line(_scenarios_detail(merged_results, tokens))


def step_bandwidth(
    rt: Runtime, backend: EPBackend, ctx: CheckContext, args: argparse.Namespace
) -> Step:
    """GB/s of dispatch and combine (received bytes / median time) and of a device copy.

    Every call gets new activations (the same tokens' payload times a power of two that
    changes from call to call, prepared before its timing starts), so no backend can answer
    from a cache, and every output is checked after its timing ends: dispatch for the tokens
    routed here, bit-exact, combine token by token against the reference.
    """
    import torch

    from ep_image.probes.check_ep import reference as ref

    with timed_step("bandwidth") as step:
        inp = ctx.inputs
        d = backend.dispatch(inp.x, inp.topk_idx, inp.topk_weights)
        y = _expert_output(rt, ctx, d)
        rows = int(d.recv_x.shape[0])
        nbytes = rows * ctx.shape.hidden * d.recv_x.element_size()

        def dispatch_wrong(i: int, out: Any) -> Any:
            f = ref.call_factor(i)
            return ref.dispatch_wrong(out.recv_x, ctx.global_routing, ctx.expected, f)

        def combine_wrong(i: int, out: Any) -> Any:
            want = ctx.expected_combine * ref.call_factor(i)
            if out.shape != want.shape:
                return torch.ones((), dtype=torch.bool, device=want.device)
            return (ref.per_token_rel_diff(out.float(), want) > ctx.tolerance).any()

        t_dispatch, bad_dispatch = _bench(
            rt,
            lambda i: ref.scale_payload(inp.x, ref.call_factor(i)),
            lambda x: backend.dispatch(x, inp.topk_idx, inp.topk_weights),
            args,
            dispatch_wrong,
        )
        t_combine, bad_combine = _bench(
            rt,
            lambda i: y * ref.call_factor(i),
            lambda y_i: backend.combine(y_i, d.handle),
            args,
            combine_wrong,
        )
        src = torch.empty(
            max(nbytes // d.recv_x.element_size(), 1), dtype=d.recv_x.dtype, device=rt.device
        )
        dst = torch.empty_like(src)
        t_copy, _ = _bench(
            rt, lambda i: None, lambda _: dst.copy_(src), args, None, collective=False
        )
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
            "checked_calls": args.warmup + args.iters,
            "shared_gpu": shared,
            "link_figure": rt.use_gpu and not shared,
        }
        if shared:
            data["note"] = SHARED_GPU_LABEL
        if len(set(rt.node_of_rank)) > 1:
            data.update(_link_split(rt, d.recv_x, nbytes, t_dispatch, t_combine))
        step.data = data
        data["dispatch_vs_copy"] = data["dispatch_gbs"] / data["copy_gbs"] if t_copy else None
        data["combine_vs_copy"] = data["combine_gbs"] / data["copy_gbs"] if t_copy else None
        calls = args.warmup + args.iters
        wrong = [
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
            if data[op + "_gbs"] < args.min_gbs
        ]
        if slow and not shared:
            raise StepFailed(
                Status.FAIL,
                f"{', '.join(slow)} below --min-gbs {args.min_gbs:g}",
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
        if datas[0].get("shared_gpu"):
            merged.detail = f"{SHARED_GPU_LABEL}: {merged.detail}; --min-gbs not applied"


def _bench(
    rt: Runtime,
    prepare: Callable[[int], Any],
    fn: Callable[[Any], Any],
    args: argparse.Namespace,
    is_wrong: Callable[[int, Any], Any] | None,
    collective: bool = True,
) -> tuple[float, list[int]]:
    """Median seconds of ``fn(prepare(i))`` after warm-up, and the calls ``is_wrong(i, out)``.

    Call ``i``'s input is prepared before its timing starts, and its check is queued after its
    end event, so neither is part of the timing.
    """
    import torch
    import torch.distributed as dist

    flags: list[Any] = []
    calls = 0

    def call() -> None:
        nonlocal calls
        out = fn(prepare(calls))
        if is_wrong is not None:
            flags.append(is_wrong(calls, out))
        calls += 1

    for _ in range(args.warmup):
        call()
    sync(rt)
    if collective:
        dist.barrier(group=rt.ctrl_group)
    times: list[float] = []
    for _ in range(args.iters):
        inp = prepare(calls)
        if rt.use_gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(inp)
            end.record()
            if is_wrong is not None:
                flags.append(is_wrong(calls, out))
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            out = fn(inp)
            times.append(time.perf_counter() - t0)
            if is_wrong is not None:
                flags.append(is_wrong(calls, out))
        calls += 1
    sync(rt)
    bad = [i for i, flag in enumerate(flags) if bool(flag)]
    return statistics.median(times), bad
