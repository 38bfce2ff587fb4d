"""Run check_ep's scenarios (``catalogue``) on this rank and check every output.

Every rank calls the backend in the same order whatever a check finds (problems are recorded,
never raised, so the ranks stay in step), leaves a breadcrumb before each call and stops at the
first call that raises, except where ``views`` finds out which views a raising call refuses
(``caller``: a precondition, agreed over the ranks in the job's store). See docs/probes.md,
sections "Scenarios" and "Preconditions".
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ep_image.probes import _supervise
from ep_image.probes._adapters.base import EPBackend, Shape
from ep_image.probes._ranks.runtime import PEER_WAIT_SECONDS, Runtime
from ep_image.probes.check_ep.reference import (
    Expected,
    GlobalRouting,
    Inputs,
    Router,
    call_factor,
    check_dispatch,
    compare_rows,
    compare_tokens,
    decode_ids,
    describe_tokens,
    dispatch_contract,
    expected_combine,
    expected_for_rank,
    expert_output,
    expert_scales,
    gather_global,
    gather_uneven,
    id_mask,
    make_inputs,
    mix_seed,
    name_row,
    output_grad,
    row_factor,
    same_values,
    scale_payload,
    tensor_contract,
    token_scale,
)
from ep_image.probes.check_ep.scenarios.caller import BackendRaised, Caller
from ep_image.probes.check_ep.scenarios.catalogue import (
    BY_NAME,
    ERROR,
    NOT_APPLICABLE,
    NOT_RUN,
    Scenario,
    not_applicable,
    scenario_seed,
    scenario_tokens,
    tokens_of,
)
from ep_image.probes.check_ep.scenarios.routing import router_of, zero_weights
from ep_image.probes.check_ep.scenarios.verdict import result_of


@dataclasses.dataclass
class Layout:
    """One routing of a scenario, its reference and what the backend returned for it."""

    index: int
    seed: int
    inputs: Inputs
    g: GlobalRouting
    exp: Expected
    d: Any = None
    ids: Any = None  # [rows] global ids the received rows name
    factor: Any = None  # [rows] the stand-in experts' factor of each received row
    out: Any = None  # what combine returned
    kept: tuple[Any, Any] = (None, None)  # copies of recv_x and of out, taken at once

    @property
    def handle(self) -> Any:
        """The dispatch's handle (None when what it returned has none: later calls still go
        to the backend, as on every other rank)."""
        return getattr(self.d, "handle", None)


@dataclasses.dataclass
class Run:
    """The state of one scenario on this rank."""

    rt: Runtime
    backend: EPBackend
    shape: Shape
    scenario: Scenario
    seed: int
    tolerance: float
    scales: torch.Tensor
    local: int
    problems: list[str] = dataclasses.field(default_factory=list)
    checks: int = 0
    caller: Caller | None = None  # views: every call through the caller's hands
    raised: int = 0  # calls that raised here and were agreed over ranks (everyone_raised)

    def __post_init__(self) -> None:
        if self.scenario.views:
            self.caller = Caller(self.call, self.check, self.everyone_raised, self.scenario.name)

    def send(self, where: str, fn: Callable[..., Any], *args: Any) -> Any:
        """A backend call as the scenario's caller makes it: with fresh tensors, or (views)
        through :class:`Caller`."""
        if self.caller is not None:
            return self.caller(where, fn, *args)
        return self.call(where, fn, *args)

    def call(
        self, where: str, fn: Callable[..., Any], *args: Any, views: dict[str, Any] | None = None
    ) -> Any:
        """Call the backend (breadcrumb first: a crash or hang is reported with ``where``, and
        in ``views`` with the tensors handed as views and what the scenario found so far)."""
        crumb: dict[str, Any] = {"scenario": f"{self.scenario.name}: {where}"}
        if self.caller is not None:
            crumb["scenario_views"] = views
            crumb["scenario_found"] = {
                "problems": self.problems[:8],
                "preconditions": self.preconditions(),
            }
        _supervise.progress.update(**crumb)
        try:
            out = fn(*args)
        except Exception as exc:
            raise BackendRaised(where, exc) from exc
        except SystemExit as exc:  # in views, ending the process is a way to refuse a view
            if self.caller is None:
                raise
            raise BackendRaised(where, exc) from exc
        if self.rt.use_gpu:
            torch.cuda.synchronize(self.rt.device)
        return out

    def preconditions(self) -> list[dict[str, Any]]:
        """The views the backend refused so far, as JSON."""
        return [r.to_json() for r in self.caller.refusals] if self.caller is not None else []

    def everyone_raised(self) -> bool:
        """After a call raised here: whether it raised on every rank at this same point, each
        rank marking it in the job's store and waiting briefly for the others (a peer whose
        call did not raise is inside the backend's collective, and never marks it)."""
        self.raised += 1
        store, env = self.rt.store, self.rt.env
        if store is None or env.world == 1:
            return True
        key = f"scenario-raised/{self.scenario.name}/{self.raised}/"
        store.set(f"{key}{env.rank}", "1")
        deadline = time.monotonic() + min(PEER_WAIT_SECONDS, self.rt.timeout)
        while time.monotonic() < deadline:
            if all(store.check([f"{key}{r}"]) for r in range(env.world)):
                return True
            time.sleep(0.02)
        return False

    def check(self, where: str, fn: Callable[..., list[str]], *args: Any) -> None:
        """Run one comparison; its problems are recorded, never raised (ranks stay in step)."""
        self.checks += 1
        try:
            found = fn(*args)
        except Exception as exc:  # a malformed output the comparison could not read
            found = [f"could not be checked ({type(exc).__name__}: {exc})"]
        self.problems.extend(f"{where}: {p}" for p in found)


def _layout(run: Run, index: int, tokens: int, router: Router | None) -> Layout:
    """One new routing of the scenario and its reference (nothing sent yet)."""
    rt, shape = run.rt, run.shape
    rank = rt.env.rank
    seed = mix_seed(run.seed, index)
    inputs = make_inputs(shape, rank, seed, tokens=tokens, route=router)
    if run.scenario.routing == "marks":
        inputs.topk_weights = zero_weights(inputs.topk_idx, inputs.topk_weights)
    g = gather_global(inputs, rt.ep_group)
    exp = expected_for_rank(g, rank, run.local, run.scales)
    return Layout(index, seed, inputs, g, exp)


def _dispatch(run: Run, lay: Layout, again: bool = False) -> Any:
    """Dispatch the layout's routing, checked; its rows named (``ids``) and the stand-in
    experts' factors found. ``again``: a second dispatch of the same routing (recompute), whose
    result is returned instead of kept as the layout's."""
    inputs, shape = lay.inputs, run.shape
    tag = f"layout {lay.index} {'dispatch again' if again else 'dispatch'}"
    d = run.send(tag, run.backend.dispatch, inputs.x, inputs.topk_idx, inputs.topk_weights)
    probe = dataclasses.replace(lay, d=d)
    run.check(tag, _dispatch_problems, run, probe)
    rows = _rows(d)
    try:
        ids = decode_ids(d.recv_x, lay.g)
        factor = row_factor(lay.exp, ids)
    except Exception:  # malformed rows (already reported): keep the ranks in step
        ids = torch.full((rows,), -1, dtype=torch.int64, device=shape.device)
        factor = torch.zeros(rows, device=shape.device)
    if again:
        return d, ids, factor
    lay.d, lay.ids, lay.factor = d, ids, factor
    return d, ids, factor


def _combine(run: Run, lay: Layout, d: Any, ids: Any, factor: Any, again: bool = False) -> None:
    """The stand-in experts on the rows ``d`` holds, combined through ``d``'s handle, checked
    against the layout's sums."""
    shape = run.shape
    tag = f"layout {lay.index} {'combine again' if again else 'combine'}"
    try:
        y = expert_output(d.recv_x, factor)
    except Exception:  # malformed rows (already reported): keep the ranks in step
        y = torch.zeros((_rows(d), shape.hidden), dtype=shape.dtype, device=shape.device)
    if run.caller is not None:
        run.caller.reuse(getattr(d, "recv_x", None))  # read: the caller's to write over now
    out = run.send(tag, run.backend.combine, y, getattr(d, "handle", None))
    want = expected_combine(lay.inputs, run.scales)
    run.check(tag, _tokens_problems, run, out, want, y.dtype, "combine")
    if again:
        return
    lay.out = out
    if run.caller is not None:
        run.caller.reuse(out)  # read: the caller's to write over now
    else:
        lay.kept = (_copy(getattr(lay.d, "recv_x", None)), _copy(out))


def _forward(run: Run, lay: Layout) -> Layout:
    """Dispatch and combine one layout, each checked."""
    _combine(run, lay, *_dispatch(run, lay))
    return lay


def _recompute(run: Run, lay: Layout) -> None:
    """The layout's routing dispatched again after later layouts went through the buffer (the
    recompute of activation checkpointing): the same tokens, counts and rows as its first
    dispatch, and a combine through the new handle that sums them right."""
    d, ids, factor = _dispatch(run, lay, again=True)
    run.check(f"layout {lay.index} dispatch again", _same_rows, lay, d, ids)
    _combine(run, lay, d, ids, factor, again=True)


def _same_rows(lay: Layout, d: Any, ids: Any) -> list[str]:
    """A second dispatch of a routing returns what its first did: as many rows, the same
    tokens, the same counts per expert (in any order)."""
    first, again = _rows(lay.d), _rows(d)
    if first != again:
        return [
            f"dispatched again after later layouts, the routing returned {again} rows where "
            f"its first dispatch returned {first} (activation checkpointing's recompute would "
            "fail: recomputed values have different metadata)"
        ]
    counts = [int(c) for c in getattr(d, "num_recv_per_expert", [])]
    if counts != [int(c) for c in getattr(lay.d, "num_recv_per_expert", [])]:
        return ["dispatched again, the routing's counts per expert changed"]
    if not torch.equal(ids.sort().values, lay.ids.sort().values):
        return ["dispatched again, the routing delivered other tokens than its first dispatch"]
    return []


def _backward(run: Run, lay: Layout) -> None:
    """New activations through the layout (``rounds``), then its two backward operations."""
    rt, shape, g, backend = run.rt, run.shape, lay.g, run.backend
    tag = f"layout {lay.index}"
    rows = _rows(lay.d)
    safe = lay.ids.clamp(min=0)
    for r in range(1, run.scenario.rounds + 1):
        f = call_factor(r)
        x_r = scale_payload(lay.inputs.x, f)
        where = f"{tag} dispatch_cached (round {r})"
        got = run.send(where, backend.dispatch_cached, x_r, lay.handle)
        want_rows = scale_payload(g.x[safe], f) if g.total else g.x[:0]
        run.check(where, _cached_problems, g, lay.ids, got, want_rows, x_r, rows, "dispatch_cached")
        y_r = expert_output(want_rows, lay.factor)
        where = f"{tag} combine (round {r})"
        out = run.send(where, backend.combine, y_r, lay.handle)
        want = expected_combine(lay.inputs, run.scales) * f
        run.check(where, _tokens_problems, run, out, want, y_r.dtype, "combine")
    n = lay.inputs.x.shape[0]
    grad = output_grad(shape, n, lay.seed, rt.env.rank)
    grad_global = gather_uneven(grad, g.counts, rt.ep_group)
    where = f"{tag} combine_backward"
    cb = run.send(where, backend.combine_backward, grad, lay.handle)
    want_rows = grad_global[safe] if g.total else grad_global[:0]
    run.check(where, _cached_problems, g, lay.ids, cb, want_rows, grad, rows, "combine_backward")
    h = expert_output(want_rows, lay.factor)
    where = f"{tag} dispatch_backward"
    db = run.send(where, backend.dispatch_backward, h, lay.handle)
    scale = token_scale(lay.inputs, run.scales)
    want = grad.float() * scale[:, None] * id_mask(shape.hidden, grad.device)
    run.check(where, _tokens_problems, run, db, want, h.dtype, "dispatch_backward")
    run.check(f"{tag} outputs", _kept_problems, lay)


def _copy(t: Any) -> Any:
    return t.clone() if isinstance(t, torch.Tensor) else None


def _kept_problems(lay: Layout) -> list[str]:
    """The layout's dispatch and combine outputs, after every later call of the scenario, still
    hold what they held when returned (an MoE layer keeps its expert input and output for the
    backward pass; memory a later call reuses would corrupt the weight gradients)."""
    found = []
    for op, now, then in (
        ("dispatch", getattr(lay.d, "recv_x", None), lay.kept[0]),
        ("combine", lay.out, lay.kept[1]),
    ):
        if then is not None and isinstance(now, torch.Tensor) and not same_values(now, then):
            found.append(
                f"what {op} returned changed after later calls (memory the backend reuses): a "
                "layer's saved activations would be overwritten before its backward pass"
            )
    return found


def _dispatch_problems(run: Run, lay: Layout) -> list[str]:
    found = dispatch_contract(lay.d, lay.inputs.x, run.shape.topk, run.local)
    return found or check_dispatch(lay.d, lay.g, lay.exp, run.local).problems


def _cached_problems(
    g: GlobalRouting,
    ids: torch.Tensor,
    got: Any,
    want: torch.Tensor,
    source: torch.Tensor,
    rows: int,
    op: str,
) -> list[str]:
    """A cached dispatch (of new activations or of the output gradient): in the dispatch's
    row order, each row bit-identical to what its token's rank passed."""
    found = tensor_contract(op, got, rows, source.shape[1], source.dtype, source.device)
    if found:
        return found
    what = (
        "the output gradient of its token"
        if op == "combine_backward"
        else ("the new activations of its token")
    )
    return _rows_problems(g, ids, got, want, what)


def _rows(d: Any) -> int:
    x = getattr(d, "recv_x", None)
    return int(x.shape[0]) if isinstance(x, torch.Tensor) and x.dim() == 2 else 0


def _tokens_problems(run: Run, out: Any, want: torch.Tensor, dtype: Any, op: str) -> list[str]:
    found = tensor_contract(op, out, want.shape[0], want.shape[1], dtype, want.device)
    c = compare_tokens(out, want, run.tolerance)
    if not c.ok:
        found.append(describe_tokens(c, "the reference", run.tolerance))
    return found


def _rows_problems(
    g: GlobalRouting, ids: torch.Tensor, out: Any, want: torch.Tensor, what: str
) -> list[str]:
    bad, first = compare_rows(out, want)
    if not bad:
        return []
    token = int(ids[first]) if 0 <= first < ids.numel() else -1
    name = name_row(g, token) if token >= 0 else "a row naming no token"
    return [
        f"{bad} of {want.shape[0]} rows are not bit-identical to {what} (first: row {first}, "
        f"{name})"
    ]


def run_one(
    rt: Runtime,
    backend: EPBackend,
    shape: Shape,
    scenario: Scenario,
    seed: int,
    tolerance: float,
) -> dict[str, Any]:
    """Run ``scenario`` on this rank; its result as JSON (status, detail, counts)."""
    local = shape.local_experts(rt.env.world)
    scales = expert_scales(shape.experts, shape.device)
    run = Run(rt, backend, shape, scenario, seed, tolerance, scales, local)
    base = scenario_tokens(shape.tokens)
    tokens = tokens_of(scenario, base, rt.env.rank, rt.env.world)
    router = router_of(scenario, shape, rt.env.world)
    start = time.perf_counter()
    layouts = [_layout(run, i, tokens, router) for i in range(scenario.layouts)]
    try:
        _drive(run, layouts)
    except BackendRaised as exc:
        # Stopped here; what it got wrong before that (and refused) is still its verdict's.
        entry = {"name": scenario.name, "seed": seed, "input": scenario.exercises}
        entry.update(status=ERROR, detail=str(exc))
        if run.problems:
            entry.update(problems=run.problems[:8], wrong_data=True)
        if run.preconditions():
            entry["preconditions"] = run.preconditions()
        return entry
    result = {"name": scenario.name, "seed": seed, "input": scenario.exercises}
    result.update(result_of(run.problems, run.preconditions()))
    result.update(
        tokens=[lay.inputs.x.shape[0] for lay in layouts],
        received=[_rows(lay.d) for lay in layouts],
        checks=run.checks,
        seconds=round(time.perf_counter() - start, 4),
    )
    return result


def _drive(run: Run, layouts: list[Layout]) -> None:
    """The scenario's calls, in the order its framework makes them."""
    rt, backend, scenario = run.rt, run.backend, run.scenario
    if scenario.lifecycle:
        # Layout 0's whole round trip on the buffer as made, then the buffer destroyed and made
        # again on the same group before layout 1.
        _backward(run, _forward(run, layouts[0]))
        dist.barrier(group=rt.ctrl_group)  # every rank done with the buffer, as at shutdown
        run.call("destroy", backend.destroy)
        run.call("create again", backend.create, rt.ep_group, run.shape)
        for lay in layouts[1:]:
            _backward(run, _forward(run, lay))
    elif scenario.interleaved:
        dispatched = [(lay, _dispatch(run, lay)) for lay in layouts]
        for lay, sent in dispatched[1:] + dispatched[:1]:  # combined in another order
            _combine(run, lay, *sent)
        for lay in reversed(layouts):
            _backward(run, lay)
    else:
        for lay in layouts:
            _forward(run, lay)
        for lay in reversed(layouts):
            if scenario.recompute:
                _recompute(run, lay)
            _backward(run, lay)


def run_all(
    rt: Runtime,
    backend: EPBackend,
    shape: Shape,
    names: list[str],
    base_seed: int,
    tolerance: float,
) -> list[dict[str, Any]]:
    """Every selected scenario in order; a backend that raises ends the rest (``not run``)."""
    results: list[dict[str, Any]] = []
    stopped: str | None = None
    for name in names:
        scenario = BY_NAME[name]
        seed = scenario_seed(base_seed, name)
        entry: dict[str, Any] = {"name": name, "seed": seed, "input": scenario.exercises}
        reason = not_applicable(backend, scenario)
        if stopped is not None:
            entry.update(status=NOT_RUN, detail=f"not run: {stopped} raised")
        elif reason is not None:
            entry.update(status=NOT_APPLICABLE, detail=reason)
        else:
            entry = run_one(rt, backend, shape, scenario, seed, tolerance)
            if entry["status"] == ERROR:
                stopped = name
        results.append(entry)
        # Kept beside the breadcrumb, so a crash in a later scenario still reports these.
        _supervise.progress.update(scenario_results=results)
    _supervise.progress.update(
        scenario=None, scenario_results=None, scenario_views=None, scenario_found=None
    )
    return results
