"""check_ep's steps, in the order they run: the gates (import, prerequisites, buffer), then the
kernel checks, each against the plain-torch reference.

Why this module exists: the order is the probe's contract, written once here (``STEPS``): the
report's step names and the loop that runs them (``_ranks/steps.py``) both read it. Each check
imports its module when it runs, in the backend process: importing this one (as the launcher
does, to name the steps) loads no torch.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ep_image.probes._ranks.runtime import agree
from ep_image.probes._ranks.steps import GATES
from ep_image.probes._ranks.types import Ends, ProbeStep, StepRun
from ep_image.probes._report import Status, Step, timed_step

if TYPE_CHECKING:
    from ep_image.probes.check_ep.checks.context import CheckContext


@dataclasses.dataclass
class CheckRun(StepRun):
    """A run of check_ep's steps: what the first check prepares for all of them."""

    #: The inputs, the reference routing and the expected outputs every check compares with.
    checks: CheckContext | None = None


def dispatch_combine(run: CheckRun) -> Step:
    """Prepare the reference every check compares with, then dispatch and combine against it:
    a reference that cannot be prepared ends the run at this step."""
    from ep_image.probes.check_ep.checks.context import prepare_checks
    from ep_image.probes.check_ep.checks.dispatch_combine import step_dispatch_combine

    with timed_step("dispatch_combine") as prep:
        run.checks = prepare_checks(run.rt, run.shape, run.options)
    if prep.status != Status.PASS:
        prep.detail = "preparing the reference failed: " + prep.detail
        return agree(run.rt, prep)
    return step_dispatch_combine(run.rt, run.backend, run.checks)


def backward(run: CheckRun) -> Step:
    from ep_image.probes.check_ep.checks.backward import step_backward

    return step_backward(run.rt, run.backend, run.checks, run.options.seed)


def replay(run: CheckRun) -> Step:
    from ep_image.probes.check_ep.checks.replay import step_replay

    return step_replay(run.rt, run.backend, run.checks, run.options.replays)


def precision(run: CheckRun) -> Step:
    from ep_image.probes.check_ep.checks.precision import step_precision

    return step_precision(run.rt, run.backend, run.checks, run.options)


def bandwidth(run: CheckRun) -> Step:
    from ep_image.probes.check_ep.checks.bandwidth import step_bandwidth

    return step_bandwidth(run.rt, run.backend, run.checks, run.options)


def scenarios(run: CheckRun) -> Step:
    from ep_image.probes.check_ep.checks.scenarios import step_scenarios

    return step_scenarios(run.rt, run.backend, run.checks, run.options)


#: The steps in the order they run: after a gate that does not pass, or a check the backend
#: raised in, the later steps are "not run".
STEPS = (
    *GATES,
    ProbeStep("dispatch_combine", dispatch_combine, Ends.ON_ERROR),
    ProbeStep("backward", backward, Ends.ON_ERROR),
    ProbeStep("replay", replay, Ends.ON_ERROR),
    ProbeStep("precision", precision, Ends.ON_ERROR),
    ProbeStep("bandwidth", bandwidth, Ends.ON_ERROR),
    # Last: a backend that refuses an input of a scenario (views) by ending its process takes
    # no other step with it.
    ProbeStep("scenarios", scenarios, Ends.ON_ERROR),
)
STEP_NAMES = tuple(step.name for step in STEPS)
#: The steps that judge the numbers the backend returns: one that failed keeps the verdict at
#: "failed" when the backend raises or crashes after it (``_report.exit_code_of``).
CHECK_STEPS = tuple(step.name for step in STEPS if step.ends is Ends.ON_ERROR)
