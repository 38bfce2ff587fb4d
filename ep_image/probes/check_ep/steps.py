"""check_ep's steps in order: the gates (import, prerequisites, buffer), then the checks.

Why this module exists: the order of the steps and what happens between them is the
probe's contract with every backend - a gate that does not pass stops the run with the
later steps "not run", a backend error (or a backend that calls ``sys.exit``) ends the checks,
and each step leaves a breadcrumb so a crash or hang is reported at the step it happened in.
"""

from __future__ import annotations

from collections.abc import Callable

from ep_image.probes import _backend_detect, _supervise
from ep_image.probes._report import Status, Step, timed_step
from ep_image.probes.check_ep.adapters.base import EPBackend
from ep_image.probes.check_ep.checks.backward import step_backward
from ep_image.probes.check_ep.checks.bandwidth import step_bandwidth
from ep_image.probes.check_ep.checks.context import prepare_checks
from ep_image.probes.check_ep.checks.dispatch_combine import step_dispatch_combine
from ep_image.probes.check_ep.checks.precision import step_precision
from ep_image.probes.check_ep.checks.replay import step_replay
from ep_image.probes.check_ep.checks.scenarios import step_scenarios
from ep_image.probes.check_ep.gates import step_buffer, step_import, step_prerequisites
from ep_image.probes.check_ep.ranks import Runtime, agree
from ep_image.probes.check_ep.types import STEP_NAMES, Options, Selection, Shape, not_run


def begin(name: str, steps: list[Step]) -> None:
    """Leave a breadcrumb: if the backend kills or hangs the process, the supervisor says where."""
    _supervise.progress.update(current=name, scenario=None, steps=[s.to_json() for s in steps])


def guarded(name: str, check: Callable[[], Step]) -> Step:
    """Run one step; a backend that calls ``sys.exit`` inside it is unusable, not finished."""
    try:
        return check()
    except SystemExit as exc:
        return Step(
            name,
            Status.ERROR,
            detail=f"the backend called sys.exit({exc.code!r}) during {name}",
            hint="a backend must raise, not exit; report it with this JSON",
        )


def run_gate(
    steps: list[Step], names: tuple[str, ...], name: str, check: Callable[[], Step]
) -> bool:
    """Run one gate step and append it to ``steps``; when it does not pass, the rest of
    ``names`` are appended as "not run" and False comes back."""
    begin(name, steps)
    step = guarded(name, check)
    step.hint = step.hint or _backend_detect.run_time_hint(step.detail)
    steps.append(step)
    if step.status != Status.PASS:
        steps.extend(not_run(n, step) for n in names[len(steps) :])
        return False
    return True


def run_gates(
    rt: Runtime, sel: Selection, backend: EPBackend, shape: Shape, names: tuple[str, ...]
) -> tuple[list[Step], bool]:
    """The three gates every probe on a backend runs first (import, prerequisites, buffer):
    the steps so far, and whether all three passed (else the rest of ``names`` are not run)."""
    steps: list[Step] = []
    passed = (
        run_gate(steps, names, "import", lambda: step_import(rt, sel, backend))
        and run_gate(steps, names, "prerequisites", lambda: step_prerequisites(rt, backend))
        and run_gate(steps, names, "buffer", lambda: step_buffer(rt, backend, shape))
    )
    return steps, passed


def run_steps(
    rt: Runtime, sel: Selection, backend: EPBackend, shape: Shape, options: Options
) -> list[Step]:
    steps, passed = run_gates(rt, sel, backend, shape, STEP_NAMES)
    if not passed:
        return steps
    begin("dispatch_combine", steps)
    with timed_step("dispatch_combine") as prep:
        ctx = prepare_checks(rt, shape, options)
    if prep.status != Status.PASS:
        prep.detail = "preparing the reference failed: " + prep.detail
        steps.append(agree(rt, prep))
        steps.extend(not_run(n, steps[-1]) for n in STEP_NAMES[len(steps) :])
        return steps
    checks: list[tuple[str, Callable[[], Step]]] = [
        ("dispatch_combine", lambda: step_dispatch_combine(rt, backend, ctx)),
        ("backward", lambda: step_backward(rt, backend, ctx, options.seed)),
        ("replay", lambda: step_replay(rt, backend, ctx, options.replays)),
        ("precision", lambda: step_precision(rt, backend, ctx, options)),
        ("bandwidth", lambda: step_bandwidth(rt, backend, ctx, options)),
        ("scenarios", lambda: step_scenarios(rt, backend, ctx, options)),
    ]
    for name, check in checks:
        begin(name, steps)
        step = guarded(name, check)
        step.hint = step.hint or _backend_detect.run_time_hint(step.detail)
        steps.append(step)
        if step.status == Status.ERROR:
            # The backend raised: its state (and the group's) is unknown, stop here.
            steps.extend(not_run(n, step) for n in STEP_NAMES[len(steps) :])
            break
    return steps
