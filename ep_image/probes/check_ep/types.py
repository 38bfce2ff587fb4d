"""The ground floor of check_ep: the options, the layer shape, the backend chosen, the rows a
dispatch returns, the input classes, the order of the steps, and what makes a probe on check_ep's
rank machinery one probe or another (``ProbeKind``).

Why this module exists: the command line, the steps, the checks, the reference and the adapters
all speak of these; defined here, below every other part of check_ep (this module imports none
of them, and no torch), they tie those parts together without an import between them that
could run in a circle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ep_image.probes._report import Status, Step

if TYPE_CHECKING:
    import torch

    from ep_image.probes._backend_detect import Installed

#: The probe's name in its table, its JSON report and its messages.
PROG = "check_ep"

#: The steps in the order they run; after a gate (the first three) that does not pass, the
#: later steps are "not run".
STEP_NAMES = (
    "import",
    "prerequisites",
    "buffer",
    "dispatch_combine",
    "backward",
    "replay",
    "precision",
    "bandwidth",
    # Last: a backend that refuses an input of a scenario (views) by ending its process takes
    # no other step with it.
    "scenarios",
)
#: The steps that judge the numbers the backend returns: one that failed keeps the verdict at
#: "failed" when the backend raises or crashes after it (``_report.exit_code_of``).
CHECK_STEPS = STEP_NAMES[3:]


def not_run(name: str, gate: Step) -> Step:
    """Step ``name``, not run because ``gate`` ended badly."""
    return Step(name, Status.NOT_RUN, detail=f"not run: {gate.name} ended '{gate.status.value}'")


#: Inputs training presents that a backend's API may not take (``EPBackend.input_limits``).
UNEVEN_TOKENS = "uneven_tokens"
DROPPED_SLOTS = "dropped_slots"
INPUT_CLASSES = {
    UNEVEN_TOKENS: "ranks holding different numbers of tokens, 0 included",
    DROPPED_SLOTS: "top-k slots with expert index -1 (dropped or padded)",
}


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """The flags of every probe on check_ep's rank machinery (check_ep, check_train), checked;
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


@dataclasses.dataclass(frozen=True)
class Options(RunOptions):
    """check_ep's command line, checked (``cli.parse_options`` makes it from argparse's
    output, once)."""

    scenarios: tuple[str, ...]  # the selected scenarios' names, in the documented order
    replays: int
    warmup: int
    iters: int
    tolerance: float | None  # None: exact where the inputs allow it, else per dtype
    min_gbs: float


@dataclasses.dataclass
class Selection:
    """Which backend to check and why; ``verdict`` is set when nothing can run."""

    name: str
    how: str
    installed: Installed | None
    verdict: Step | None = None
    custom: bool = False


@dataclasses.dataclass(frozen=True)
class Shape:
    """The MoE layer the probe emulates; buffers are sized from it."""

    tokens: int  # tokens per rank
    hidden: int
    experts: int  # experts over all ranks
    topk: int
    dtype: torch.dtype
    device: torch.device

    def local_experts(self, world_size: int) -> int:
        return self.experts // world_size


@dataclasses.dataclass
class Dispatched:
    """What a rank receives from dispatch (the layout: ``adapters/base.py``'s docstring)."""

    recv_x: torch.Tensor  # [rows, hidden]
    recv_topk_idx: torch.Tensor  # [rows, k] local expert index or -1
    recv_topk_weights: torch.Tensor  # [rows, k] float32
    num_recv_per_expert: list[int]  # [local experts]
    handle: Any


@dataclasses.dataclass(frozen=True)
class ProbeKind:
    """One probe on check_ep's rank machinery: its launcher (``--nproc-per-node``), each rank's
    supervisor, the worker's placement, groups and gates, and the report of a run that did not
    finish. check_ep and check_train share all of that and differ only in what is named here.

    ``run_steps`` is a ``module:function`` path, imported in the backend process only (it
    needs torch): ``(rt, sel, backend, shape, options) -> list[Step]``.
    """

    prog: str  # the name in the table, the JSON report and messages
    front_door: str  # the script users run, for messages: probes/<prog>.py
    module: str  # what the ranks of --nproc-per-node run: python -m MODULE
    step_names: tuple[str, ...]
    run_steps: str
    sizes: Callable[[Any, bool, int], dict[str, int]]  # (options, on a GPU, world) -> shape
    default_dtype: Callable[[bool], str]  # (a GPU backend or a GPU) -> dtype of --dtype auto
    meta: Callable[[Any, dict[str, int]], dict[str, Any]]  # (options, shape) -> report fields
    header: Callable[[Selection, Any, dict[str, Any]], list[str]]  # (sel, env, meta)
    numbers: Callable[[list[Step]], dict[str, Any]]  # the report's headline numbers
    #: The steps whose failure means the backend returned wrong numbers: an error after one
    #: leaves the verdict at "failed" (``_report.exit_code_of``). None: every error is
    #: "unusable".
    judged: tuple[str, ...] = ()
