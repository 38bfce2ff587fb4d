"""The ground floor of the rank machinery: the flags every probe on a backend takes, the backend
chosen, a probe's steps, what a run of them holds, and what makes one probe on this machinery
one probe or another (``ProbeKind``).

Why this module exists: the launcher, the supervisors, the worker, the step loop and the report
all speak of these; defined here, below every other part of ``_ranks`` (this module imports
none of them, and no torch), they tie those parts together without an import between them that
could run in a circle.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ep_image.probes._report import Status, Step

if TYPE_CHECKING:
    from ep_image.probes._adapters.base import EPBackend, Shape
    from ep_image.probes._backend_detect import Installed
    from ep_image.probes._ranks.runtime import Runtime
    from ep_image.probes._supervise import Outcome


def not_run(name: str, gate: Step) -> Step:
    """Step ``name``, not run because ``gate`` ended badly."""
    return Step(name, Status.NOT_RUN, detail=f"not run: {gate.name} ended '{gate.status.value}'")


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """The flags of every probe on the rank machinery (check_ep, check_train), checked;
    docs/probes.md, section "Flags", says what each one means."""

    backend: str  # auto, a registry name or torch
    backend_class: str | None  # FILE.py:Class or package.module:Class, instead of backend
    tokens: int | None  # the layer shape; None: the default of the device the rank gets
    hidden: int | None
    experts: int | None
    topk: int | None
    dtype: str  # auto or a torch dtype name
    device: str  # auto, cuda or cpu
    seed: int
    timeout: float  # seconds a step or a collective may take
    json: Path | None
    require: bool
    nproc_per_node: int  # 0: this process is one rank (alone or under torchrun)
    ranks_per_gpu: int


@dataclasses.dataclass
class Selection:
    """Which backend to check and why; ``verdict`` is set when nothing can run."""

    name: str
    how: str
    installed: Installed | None
    verdict: Step | None = None
    custom: bool = False


class Ends(enum.Enum):
    """Which verdict of a step ends the run, every later step then "not run"."""

    #: A gate: anything but a pass (nothing after it can run without it).
    UNLESS_PASSED = "gate"
    #: A check: an error (the backend raised: its state, and its group's, is unknown).
    ON_ERROR = "check"
    #: A verdict drawn from what ran before, calling no backend: none.
    NEVER = "verdict"

    def stops(self, step: Step) -> bool:
        """Whether ``step``'s verdict ends the run."""
        if self is Ends.UNLESS_PASSED:
            return step.status != Status.PASS
        if self is Ends.ON_ERROR:
            return step.status == Status.ERROR
        return False


@dataclasses.dataclass
class StepRun:
    """What a probe's steps run on, in the backend process; a probe's own subclass adds what
    its steps leave for the later ones (check_ep's reference, check_train's model)."""

    rt: Runtime
    sel: Selection
    backend: EPBackend
    shape: Shape
    sizes: dict[str, int]  # the shape's sizes, each device default filled in (ProbeKind.sizes)
    options: Any  # the probe's own options: a RunOptions subclass
    #: Set by ``end``: the run ends after the step that set it, the later steps with this detail.
    ended: str | None = None

    def end(self, detail: str) -> None:
        """End the run after the current step, whatever its verdict: the later steps are "not
        run", with ``detail`` (check_train's settings that do not train judge no backend)."""
        self.ended = detail


@dataclasses.dataclass(frozen=True)
class ProbeStep:
    """One step of a probe: its name in the report, the function that runs it on a
    :class:`StepRun` in the backend process (torch is imported inside it, never when its module
    is), and which verdict of it ends the run."""

    name: str
    run: Callable[[Any], Step]
    ends: Ends = Ends.ON_ERROR


@dataclasses.dataclass(frozen=True)
class Unfinished:
    """A run that did not finish, as rank 0's supervisor knows it: the probe's options, its own
    backend process's ``Outcome``, every rank's posted outcome, and the failure reported (the
    rank that failed first, and its outcome)."""

    options: Any
    own: Outcome
    outcomes: dict[int, dict[str, Any]]
    rank: int
    failure: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ProbeKind:
    """One probe on the rank machinery: its launcher (``--nproc-per-node``), each rank's
    supervisor, the worker's placement, groups and gates, the step loop and the report of a run
    that did not finish. check_ep and check_train share all of that and differ only in what is
    named here.
    """

    prog: str  # the name in the table, the JSON report and messages
    front_door: str  # the script users run, for messages: probes/<prog>.py
    module: str  # what the ranks of --nproc-per-node run: python -m MODULE
    #: The steps in the order they run; the report's step names are theirs.
    steps: tuple[ProbeStep, ...]
    sizes: Callable[[Any, bool, int], dict[str, int]]  # (options, on a GPU, world) -> shape
    default_dtype: Callable[[bool], str]  # (a GPU backend or a GPU) -> dtype of --dtype auto
    meta: Callable[[Any, dict[str, int]], dict[str, Any]]  # (options, shape) -> report fields
    header: Callable[[Selection, Any, dict[str, Any]], list[str]]  # (sel, env, meta)
    numbers: Callable[[list[Step]], dict[str, Any]]  # the report's headline numbers
    #: What the steps run on (a :class:`StepRun` subclass holding what the probe's steps share).
    run_type: type[StepRun] = StepRun
    #: The steps whose failure means the backend returned wrong numbers: an error after one
    #: leaves the verdict at "failed" (``_report.exit_code_of``). Empty: every error is
    #: "unusable".
    judged: tuple[str, ...] = ()
    #: Fields the probe adds to its report from its steps, and the line its table ends with
    #: (check_ep's: the preconditions a backend stated).
    notes: Callable[[Selection, list[Step]], tuple[dict[str, Any], str]] | None = None
    #: The probe's own reading of the step a run that did not finish ended in: the step as the
    #: machinery reports it in, the step to report (check_ep's: the scenarios finished, a
    #: backend that refused views by ending its process).
    unfinished: Callable[[Step, Unfinished], Step] | None = None

    @property
    def step_names(self) -> tuple[str, ...]:
        """The steps' names, in the order they run."""
        return tuple(step.name for step in self.steps)
