"""check_train's steps, in the order they run: the gates every rank probe runs, the model, the
two trainings, the verdicts drawn from them.

Why this module exists: the order is the probe's contract, written once here (``STEPS``): the
report's step names and the loop that runs them (``_ranks/steps.py``) both read it. The
fallback trains first (the oracle, and what a rank has if the backend then crashes), then the
backend; every step is agreed over the ranks, and a backend that raises ends the run with the
later steps not run, its peers stopped in seconds. Each step imports what it runs (torch, the
model) when it runs, in the backend process: importing this module loads no torch.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from ep_image.probes import _cudnn_libs, _mapped
from ep_image.probes._ranks.runtime import ONE_RANK_LABEL, SHARED_GPU_LABEL, Runtime, agree
from ep_image.probes._ranks.steps import GATES, guarded
from ep_image.probes._ranks.types import Ends, ProbeStep, StepRun
from ep_image.probes._report import Status, Step, StepFailed, timed_step
from ep_image.probes.check_train.types import lr_for

if TYPE_CHECKING:
    from ep_image.probes.check_train.exchange import BackendExchange, FallbackExchange
    from ep_image.probes.check_train.loop import Phase, PhaseResult, Trainer
    from ep_image.probes.check_train.recompute import RecomputeLedger


@dataclasses.dataclass
class TrainRun(StepRun):
    """A run of check_train's steps: what the model step settles for both trainings, and what
    each training found, for the verdicts."""

    phase: Phase | None = None  # the model, its seed and how it trains: both trainings'
    ledger: RecomputeLedger | None = None  # each recompute held against its forward
    results: dict[str, PhaseResult] = dataclasses.field(default_factory=dict)  # by step

    @property
    def tokens(self) -> int:
        """Tokens per step over all ranks."""
        assert self.phase is not None
        return self.phase.shape.tokens * self.phase.world

    @property
    def local_experts(self) -> int:
        """Experts on each rank."""
        assert self.phase is not None
        return self.phase.shape.experts // self.phase.world

    def fallback_exchange(self, trainer: Trainer) -> FallbackExchange:
        """The all-gather fallback's exchange, for ``trainer``'s experts."""
        from ep_image.probes.check_train.exchange import FallbackExchange

        return FallbackExchange(
            trainer.experts_of, self.rt.ep_group, self.rt.env.rank, self.local_experts
        )

    def backend_exchange(self, trainer: Trainer) -> BackendExchange:
        """The backend's exchange, for ``trainer``'s experts, its recomputes in the ledger."""
        from ep_image.probes.check_train.exchange import BackendExchange

        return BackendExchange(
            self.backend, trainer.experts_of, self.rt.env.rank, self.local_experts, self.ledger
        )


def model(run: TrainRun) -> Step:
    """Which layers the model runs (TE's or torch's), agreed over the ranks; once it passes, the
    phase both trainings share and the ledger the recomputes are held against."""
    from ep_image.probes.check_train import loop
    from ep_image.probes.check_train.layers import step_model
    from ep_image.probes.check_train.model import ModelShape
    from ep_image.probes.check_train.recompute import RecomputeLedger

    found, te = step_model(run.options.te, run.rt.use_gpu)
    step = agree(run.rt, found)
    if step.status == Status.PASS:
        run.phase = loop.Phase(
            shape=ModelShape.of(run.sizes),
            seed=run.options.seed,
            rank=run.rt.env.rank,
            world=run.rt.env.world,
            device=run.rt.device,
            dtype=run.shape.dtype,
            group=run.rt.ep_group,
            lr=lr_for(run.sizes["hidden"], run.options.lr),
            steps=run.sizes["steps"],
            te=te,
        )
        run.ledger = RecomputeLedger(run.rt.ctrl_group, run.options.recompute)
    return step


def fallback(run: TrainRun) -> Step:
    """The model trained with the all-gather fallback: the oracle, trained first so that a
    rank has it even if the backend then crashes."""
    from ep_image.probes.check_train import loop, verdicts

    def trained() -> Step:
        result = loop.train_fallback(run.phase, run.fallback_exchange, run.options.checkpoint)
        run.results["fallback"] = result
        return verdicts.step_fallback(result, run.tokens)

    return _training(run, "fallback", trained)


def train(run: TrainRun) -> Step:
    """The model trained on the backend, each step held against its references."""
    from ep_image.probes.check_train import loop, verdicts

    def trained() -> Step:
        result = loop.train_backend(
            run.phase, run.backend_exchange, run.fallback_exchange, run.options.checkpoint
        )
        run.results["train"] = result
        return verdicts.step_train(result, run.tokens, run.options.checkpoint)

    return _training(run, "train", trained)


def _training(run: TrainRun, name: str, trained: Callable[[], Step]) -> Step:
    """A training's verdict, agreed over the ranks; settings the model did not learn with end
    the run (nothing later is judged: the settings', not the backend's fault)."""
    from ep_image.probes.check_train import verdicts

    step = guarded(name, lambda: _raised_as_error(name, trained))
    step = agree(run.rt, step, _same_everywhere)
    if step.data.get("did_not_train"):
        run.end(verdicts.NOT_JUDGED)
    return step


def recompute(run: TrainRun) -> Step:
    """Every recomputed dispatch against its forward's, and checkpointing against none."""
    from ep_image.probes.check_train import verdicts

    assert run.phase is not None and run.ledger is not None
    layers, checks = run.phase.shape.layers, run.ledger.checks
    return _verdict(
        run,
        "recompute",
        lambda: verdicts.step_recompute(
            run.results["train"], layers, run.options.checkpoint, checks, run.options.recompute
        ),
    )


def agreement(run: TrainRun) -> Step:
    """The backend's losses and gradients against the fallback's, at the same weights."""
    from ep_image.probes.check_train import verdicts

    assert run.phase is not None
    backend_result, fallback_result = run.results["train"], run.results["fallback"]
    layers = run.phase.shape.layers
    return _verdict(
        run,
        "agreement",
        lambda: verdicts.step_agreement(backend_result, fallback_result, layers),
    )


def memory(run: TrainRun) -> Step:
    """Live memory that must not grow, and both trainings' peaks (the largest over ranks)."""
    from ep_image.probes.check_train import verdicts

    backend_result, fallback_result = run.results["train"], run.results["fallback"]
    return _verdict(
        run,
        "memory",
        lambda: verdicts.step_memory(backend_result, fallback_result),
        _worst_memory,
    )


def speed(run: TrainRun) -> Step:
    """The backend's step time beside the fallback's, taken in turn."""
    from ep_image.probes.check_train import verdicts

    backend_result, fallback_result = run.results["train"], run.results["fallback"]
    reference = run.sel.name == "torch"
    label = _label(run.rt)
    return _verdict(
        run,
        "speed",
        lambda: verdicts.step_speed(backend_result, fallback_result, run.tokens, label, reference),
    )


def libraries(run: TrainRun) -> Step:
    """The libraries mapped with TE and the backend loaded and trained together."""
    return _verdict(run, "libraries", step_libraries)


def _verdict(
    run: TrainRun,
    name: str,
    check: Callable[[], Step],
    summary: Callable[[Step, list[Step]], None] | None = None,
) -> Step:
    """A verdict drawn from the trainings, agreed over the ranks (alike on every rank unless
    ``summary`` says how to merge them)."""
    return agree(run.rt, guarded(name, check), summary or _same_everywhere)


#: The steps in the order they run: the gates every rank probe runs, then the model, the
#: fallback's training (the oracle), the backend's, the verdicts drawn from them, and the
#: libraries the process mapped with everything loaded.
STEPS = (
    *GATES,
    ProbeStep("model", model, Ends.UNLESS_PASSED),
    ProbeStep("fallback", fallback, Ends.ON_ERROR),
    ProbeStep("train", train, Ends.ON_ERROR),
    ProbeStep("recompute", recompute, Ends.NEVER),
    ProbeStep("agreement", agreement, Ends.NEVER),
    ProbeStep("memory", memory, Ends.NEVER),
    ProbeStep("speed", speed, Ends.NEVER),
    ProbeStep("libraries", libraries, Ends.NEVER),
)
STEP_NAMES = tuple(step.name for step in STEPS)


def _raised_as_error(name: str, run: Callable[[], Step]) -> Step:
    """``run()``'s verdict, or an ERROR step naming what raised inside the training (the
    backend, most often: it is unusable, exit 3)."""
    verdict: list[Step] = []
    with timed_step(name) as raised:
        verdict.append(run())
    if not verdict:
        return raised
    verdict[0].seconds = raised.seconds  # the training's time, not only its verdict's
    return verdict[0]


def _label(rt: Runtime) -> str:
    """What a step time here is not: a figure of the link, when no link is crossed."""
    if rt.placement.shared:
        return SHARED_GPU_LABEL
    if not rt.use_gpu:
        return "CPU: not a GPU figure"
    if rt.env.world == 1:
        return ONE_RANK_LABEL
    return ""


def _same_everywhere(merged: Step, per_rank: list[Step]) -> None:
    """A verdict every rank reached alike (the trainings' losses and gradients are summed over
    the ranks) reads as one, without "rank 0: ... (and N more ranks)"."""
    first = per_rank[0]
    if all(s.status == first.status and s.detail == first.detail for s in per_rank):
        merged.detail = first.detail


def _worst_memory(merged: Step, per_rank: list[Step]) -> None:
    """Memory over ranks: each rank's live bytes per step, the largest peaks."""
    merged.data["live_bytes_per_rank"] = [s.data.get("live_bytes_per_step") for s in per_rank]
    for key in ("backend_peak_bytes", "fallback_peak_bytes"):
        values = [s.data.get(key) for s in per_rank if s.data.get(key) is not None]
        merged.data[key] = max(values) if values else None


def step_libraries() -> Step:
    """The NCCL, cuDNN and NVSHMEM libraries this process mapped, with TE and the backend
    loaded together and trained: one libnccl (DeepEP v2 refuses two), one cuDNN release."""
    import torch

    with timed_step("libraries") as step:
        nccl = sorted({os.path.realpath(p) for p in _mapped.mapped_libraries(r"^libnccl\.so")})
        nvshmem = sorted({os.path.realpath(p) for p in _mapped.mapped_libraries(r"^libnvshmem")})
        cudnn = _cudnn_libs.survey()
        step.data = {
            "nccl": nccl,
            "nvshmem": nvshmem,
            "cudnn_dirs": cudnn["dirs"],
            "cudnn_version": cudnn["reference_version"],
            "te_loaded": bool(_mapped.mapped_libraries(r"^libtransformer_engine")),
            "torch_cuda": torch.version.cuda,
        }
        if len(nccl) > 1:
            raise StepFailed(
                Status.ERROR,
                f"{len(nccl)} libnccl are mapped: {', '.join(nccl)}",
                "load one NCCL: the venv's nvidia/nccl/lib (DeepEP v2 stops at import when it "
                "finds a second); remove the other from LD_LIBRARY_PATH and LD_PRELOAD",
                step.data,
            )
        mixed = _cudnn_libs.judge(cudnn)
        if mixed is not None:
            raise StepFailed(Status.FAIL, mixed[0], mixed[1], step.data)
        parts = [f"NCCL {nccl[0]}" if nccl else "no libnccl"]
        if cudnn["dirs"]:
            parts.append(f"cuDNN {cudnn['reference_version']} from {cudnn['reference_dir']}")
        else:
            parts.append("no cuDNN")
        parts.append(f"NVSHMEM {nvshmem[0]}" if nvshmem else "no NVSHMEM")
        te = "TE and the backend in one process" if step.data["te_loaded"] else "no TE loaded"
        step.detail = f"{te}: " + "; ".join(parts)
    return step
