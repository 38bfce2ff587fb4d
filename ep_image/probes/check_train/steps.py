"""check_train's steps in order: check_ep's gates, the model, the two trainings, the verdicts.

Why this module exists: the order is the probe's contract. The gates (import, prerequisites,
buffer) are check_ep's own; the fallback trains first (the oracle, and what a rank has if the
backend then crashes), then the backend; every step is agreed over the ranks, and a backend
that raises ends the run with the later steps not run, its peers stopped in seconds.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from ep_image.probes import _cudnn_libs, _facts
from ep_image.probes._report import Status, Step, StepFailed, timed_step
from ep_image.probes.check_ep.adapters.base import EPBackend
from ep_image.probes.check_ep.ranks import ONE_RANK_LABEL, SHARED_GPU_LABEL, Runtime, agree
from ep_image.probes.check_ep.steps import begin, guarded, run_gate, run_gates
from ep_image.probes.check_ep.types import Selection, Shape, not_run
from ep_image.probes.check_train import loop, verdicts
from ep_image.probes.check_train.exchange import BackendExchange, FallbackExchange
from ep_image.probes.check_train.kind import model_sizes
from ep_image.probes.check_train.layers import step_model
from ep_image.probes.check_train.model import ModelShape
from ep_image.probes.check_train.recompute import RecomputeLedger
from ep_image.probes.check_train.types import STEP_NAMES, TrainOptions, lr_for


def run_steps(
    rt: Runtime, sel: Selection, backend: EPBackend, shape: Shape, options: TrainOptions
) -> list[Step]:
    steps, passed = run_gates(rt, sel, backend, shape, STEP_NAMES)
    if not passed:
        return steps
    model_box: list[Any] = []

    def model() -> Step:
        step, te = step_model(options.te, rt.use_gpu)
        model_box.append(te)
        return agree(rt, step)

    if not run_gate(steps, STEP_NAMES, "model", model):
        return steps
    sizes = model_sizes(options, rt.use_gpu, rt.env.world)
    phase = loop.Phase(
        shape=ModelShape.of(sizes),
        seed=options.seed,
        rank=rt.env.rank,
        world=rt.env.world,
        device=rt.device,
        dtype=shape.dtype,
        group=rt.ep_group,
        lr=lr_for(sizes["hidden"], options.lr),
        steps=sizes["steps"],
        te=model_box[0],
    )
    tokens = phase.shape.tokens * phase.world
    local = phase.shape.experts // phase.world
    checkpointed = options.checkpoint
    ledger = RecomputeLedger(rt.ctrl_group, options.recompute)

    def fallback_of(trainer: loop.Trainer) -> FallbackExchange:
        return FallbackExchange(trainer.experts_of, rt.ep_group, rt.env.rank, local)

    def backend_of(trainer: loop.Trainer) -> BackendExchange:
        return BackendExchange(backend, trainer.experts_of, rt.env.rank, local, ledger)

    results: dict[str, loop.PhaseResult] = {}

    def fallback() -> Step:
        results["fallback"] = loop.train_fallback(phase, fallback_of, checkpointed)
        return verdicts.step_fallback(results["fallback"], tokens)

    def train() -> Step:
        results["train"] = loop.train_backend(phase, backend_of, fallback_of, checkpointed)
        return verdicts.step_train(results["train"], tokens, checkpointed)

    for name, run in (("fallback", fallback), ("train", train)):
        begin(name, steps)
        step = guarded(name, lambda name=name, run=run: _raised_as_error(name, run))
        step = agree(rt, step, _same_everywhere)
        steps.append(step)
        if step.status == Status.ERROR:
            steps.extend(not_run(n, step) for n in STEP_NAMES[len(steps) :])
            return steps
        if step.data.get("did_not_train"):  # the settings', not the backend's: not judged
            steps.extend(
                Step(n, Status.NOT_RUN, detail=verdicts.NOT_JUDGED)
                for n in STEP_NAMES[len(steps) :]
            )
            return steps
    backend_result, fallback_result = results["train"], results["fallback"]
    layers = phase.shape.layers
    reference = sel.name == "torch"
    verdict_steps: list[tuple[str, Callable[[], Step]]] = [
        (
            "recompute",
            lambda: verdicts.step_recompute(
                backend_result, layers, checkpointed, ledger.checks, options.recompute
            ),
        ),
        ("agreement", lambda: verdicts.step_agreement(backend_result, fallback_result, layers)),
        ("memory", lambda: verdicts.step_memory(backend_result, fallback_result)),
        (
            "speed",
            lambda: verdicts.step_speed(
                backend_result, fallback_result, tokens, _label(rt), reference
            ),
        ),
        ("libraries", step_libraries),
    ]
    for name, check in verdict_steps:
        begin(name, steps)
        summary = _worst_memory if name == "memory" else _same_everywhere
        steps.append(agree(rt, guarded(name, check), summary))
    return steps


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
    with timed_step("libraries") as step:
        nccl = sorted({os.path.realpath(p) for p in _facts.mapped_libraries(r"^libnccl\.so")})
        nvshmem = sorted({os.path.realpath(p) for p in _facts.mapped_libraries(r"^libnvshmem")})
        cudnn = _cudnn_libs.survey()
        step.data = {
            "nccl": nccl,
            "nvshmem": nvshmem,
            "cudnn_dirs": cudnn["dirs"],
            "cudnn_version": cudnn["reference_version"],
            "te_loaded": bool(_facts.mapped_libraries(r"^libtransformer_engine")),
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
