"""The one step loop of every probe on the rank machinery, and the gates they all begin with.

Why this module exists: the order of the steps and what happens between them is a probe's
contract with every backend - a gate that does not pass stops the run with the later steps
"not run", a backend error (or a backend that calls ``sys.exit``) ends the checks, and each
step leaves a breadcrumb so a crash or hang is reported at the step it happened in. Each probe
names its steps once (a tuple of :class:`ProbeStep`, check_ep's and check_train's ``STEPS``);
this loop runs them, the same way for both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ep_image.probes import _backend_detect, _supervise
from ep_image.probes._ranks.gates import step_buffer, step_import, step_prerequisites
from ep_image.probes._ranks.types import Ends, ProbeStep, StepRun, not_run
from ep_image.probes._report import Status, Step


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


def run_steps(plan: Sequence[ProbeStep], run: StepRun) -> list[Step]:
    """Run ``plan`` in order on ``run``: each step after a breadcrumb, with the fix of a known
    run-time error; a step whose verdict ends the run (``ProbeStep.ends``), or that ended it
    itself (``StepRun.end``), leaves the later steps "not run"."""
    steps: list[Step] = []
    for index, probe_step in enumerate(plan):
        begin(probe_step.name, steps)
        step = guarded(probe_step.name, lambda probe_step=probe_step: probe_step.run(run))
        step.hint = step.hint or _backend_detect.run_time_hint(step.detail)
        steps.append(step)
        later = [s.name for s in plan[index + 1 :]]
        if probe_step.ends.stops(step):
            steps.extend(not_run(name, step) for name in later)
            break
        if run.ended is not None:
            steps.extend(Step(name, Status.NOT_RUN, detail=run.ended) for name in later)
            break
    return steps


def _import(run: StepRun) -> Step:
    return step_import(run.rt, run.sel, run.backend)


def _prerequisites(run: StepRun) -> Step:
    return step_prerequisites(run.rt, run.backend)


def _buffer(run: StepRun) -> Step:
    return step_buffer(run.rt, run.backend, run.shape)


#: The three gates every probe on a backend runs first: the backend imports, this machine can
#: run it, its buffer is built.
GATES = (
    ProbeStep("import", _import, Ends.UNLESS_PASSED),
    ProbeStep("prerequisites", _prerequisites, Ends.UNLESS_PASSED),
    ProbeStep("buffer", _buffer, Ends.UNLESS_PASSED),
)
