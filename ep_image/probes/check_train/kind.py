"""check_train as a :class:`ProbeKind` of the rank machinery, with its model's shape.

Why this module exists: the launcher, the supervisors, placement, the gates and the report of a
run that did not finish are the rank machinery's (``_ranks``), shared with check_ep; this says
what check_train adds to them (its steps, its shape and defaults, its table's header and the
report's headline numbers) without importing torch.
"""

from __future__ import annotations

from typing import Any

from ep_image.cli import UsageError
from ep_image.probes._ranks import layer
from ep_image.probes._ranks.output import header_lines
from ep_image.probes._ranks.runtime import RankEnv
from ep_image.probes._ranks.types import ProbeKind, Selection
from ep_image.probes.check_train.steps import STEPS, TrainRun
from ep_image.probes.check_train.types import (
    CPU_DEFAULTS,
    GPU_DEFAULTS,
    PROG,
    VOCAB,
    TrainOptions,
    agreement_bound,
    lr_for,
)

_LAYER_KEYS = ("tokens", "hidden", "experts", "topk")


def model_sizes(options: TrainOptions, on_gpu: bool, world: int) -> dict[str, int]:
    """The model's shape: each size not given on the command line from the device's defaults,
    checked (the layer's sizes by every rank probe's rules, then the model's own)."""
    defaults = GPU_DEFAULTS if on_gpu else CPU_DEFAULTS
    sizes = layer.layer_sizes(
        options,
        on_gpu,
        world,
        {k: GPU_DEFAULTS[k] for k in _LAYER_KEYS},
        {k: CPU_DEFAULTS[k] for k in _LAYER_KEYS},
    )
    for key in ("layers", "steps", "seq", "heads"):
        given = getattr(options, key)
        sizes[key] = given if given is not None else defaults[key]
    validate_model(sizes, options.seq is not None, world)
    return sizes


def min_tokens(sizes: dict[str, int], world: int) -> tuple[int, str]:
    """The fewest tokens per rank and step the model can train on, and why: each step's
    top-k slots must be at least the experts (else some expert gets no token to train on, at
    every step), and the whole run must show the model at least the task's VOCAB transitions
    (its batches are drawn afresh each step: with fewer, the loss on each new batch falls by
    luck if at all; measured on the CPU model: 8 steps of 4 tokens did not learn, of 8 did)."""
    experts, topk, steps = sizes["experts"], sizes["topk"], sizes["steps"]
    for_experts = -(-experts // (world * topk))
    for_task = -(-VOCAB // (world * steps))
    if for_experts >= for_task:
        why = (
            f"each step's {world} x --tokens x top-{topk} slots must reach every one of the "
            f"{experts} experts (else some never get a token to train on)"
        )
        return for_experts, why
    why = (
        f"the run must show the model at least the task's {VOCAB} transitions ({world} x "
        f"--tokens x {steps} steps; with fewer its loss falls by luck if at all)"
    )
    return for_task, why


def validate_model(sizes: dict[str, int], seq_given: bool, world: int = 1) -> None:
    """What the model needs of its shape: enough tokens to train on (``min_tokens``), whole
    sequences per rank, whole heads."""
    if sizes["steps"] >= 2:  # fewer steps are refused below, with their own reason
        fewest, why = min_tokens(sizes, world)
        if sizes["tokens"] < fewest:
            raise UsageError(
                f"--tokens {sizes['tokens']} is too few to train on: {why}, so at least "
                f"{fewest} per rank here"
            )
    tokens, seq = sizes["tokens"], sizes["seq"]
    if not seq_given and tokens % seq:
        sizes["seq"] = seq = min(seq, tokens)  # a small --tokens takes one shorter sequence
    if tokens % seq:
        raise UsageError(f"--tokens {tokens} is not a multiple of --seq {seq}")
    if sizes["hidden"] % sizes["heads"]:
        raise UsageError(f"--hidden {sizes['hidden']} is not divisible by --heads {sizes['heads']}")
    if sizes["steps"] < 2:
        raise UsageError(f"--steps must be at least 2 (the loss must fall), got {sizes['steps']}")


def meta(options: TrainOptions, sizes: dict[str, int]) -> dict[str, Any]:
    """check_train's own fields of the report."""
    return {
        "training": {
            "checkpoint": options.checkpoint,
            "recompute": options.recompute if options.checkpoint else None,
            # Whose handle the backward of a recomputed layer uses: the recompute's dispatch's
            # (as a reentrant recompute), or the forward's (--recompute cached dispatches
            # along it).
            "backward_handle": (
                None
                if not options.checkpoint
                else "forward's"
                if options.recompute == "cached"
                else "recompute's"
            ),
            "lr": lr_for(sizes["hidden"], options.lr),
            "te": options.te,
            "agreement_bound": agreement_bound(sizes["layers"]),
        }
    }


def header(sel: Selection, env: RankEnv, meta_: dict[str, Any]) -> list[str]:
    """The table's header: every rank probe's, with the model's depth, steps and checkpointing."""
    lines = header_lines(sel, env, meta_)
    shape, training = meta_.get("shape"), meta_.get("training")
    if shape and training:
        if not training["checkpoint"]:
            ckpt = "checkpointing off"
        elif training["recompute"] == "cached":
            ckpt = (
                "checkpointing on (non-reentrant), recompute by cached dispatch (forward's handle)"
            )
        else:
            ckpt = (
                "checkpointing on (non-reentrant), recompute by dispatch, its handle used by the "
                "backward (as a reentrant recompute)"
            )
        lines.append(
            f"{shape['layers']} MoE layers, {shape['steps']} steps of {shape['tokens']} tokens "
            f"({shape['seq']}-token sequences, {shape['heads']} heads), AdamW lr "
            f"{training['lr']:g}, {ckpt}"
        )
    return lines


def numbers(steps: list[Any]) -> dict[str, Any]:
    """The report's headline numbers, each phase's side by side: losses, gradient norms, step
    times, the agreement, memory."""
    by_name = {s.name: s.data for s in steps}
    out: dict[str, Any] = {}
    for key in ("losses", "grad_norms", "step_seconds", "median_step_seconds"):
        phases = {
            label: by_name[name][key]
            for label, name in (("fallback", "fallback"), ("backend", "train"))
            if key in by_name.get(name, {})
        }
        if phases:
            out[key] = phases
    speed = by_name.get("speed", {})
    for key in (
        "speedup",
        "backend_step_seconds",
        "fallback_step_seconds",
        "backend_tokens_per_second",
        "fallback_tokens_per_second",
        "label",
    ):
        if key in speed:
            out[key] = speed[key]
    recompute = by_name.get("recompute", {})
    for key in ("findings", "frameworks"):
        if key in recompute:
            out[f"recompute_{key}"] = recompute[key]
    agreement = by_name.get("agreement", {})
    for key in ("bound", "max_loss_rel_diff", "max_grad_norm_rel_diff", "max_grad_rel_diff"):
        if key in agreement:
            out[f"agreement_{key}"] = agreement[key]
    memory = by_name.get("memory", {})
    for key in ("backend_peak_bytes", "fallback_peak_bytes", "live_bytes_per_step"):
        if key in memory:
            out[key] = memory[key]
    return out


def default_dtype(_on_gpu: bool) -> str:
    """bf16 compute on every device: what training runs (master weights stay fp32)."""
    return "bfloat16"


CHECK_TRAIN = ProbeKind(
    prog=PROG,
    front_door="probes/check_train.py",
    module="ep_image.probes.check_train",
    steps=STEPS,
    run_type=TrainRun,
    sizes=model_sizes,
    default_dtype=default_dtype,
    meta=meta,
    header=header,
    numbers=numbers,
)
