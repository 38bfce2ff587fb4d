"""The ground floor of check_train: its options, the model's shape and defaults, and the bound
its comparisons hold.

Why this module exists: the command line, the model, the training loop and the verdicts all
speak of these; defined here, without torch and below every other part of check_train, they
tie those parts together without an import running in a circle.
"""

from __future__ import annotations

import dataclasses

from ep_image.probes._ranks.types import RunOptions

#: The probe's name in its table, its JSON report and its messages.
PROG = "check_train"

#: The model on a GPU: a small MoE transformer at a size where the exchange matters.
GPU_DEFAULTS = {
    "tokens": 4096,
    "hidden": 1024,
    "experts": 32,
    "topk": 4,
    "layers": 2,
    "steps": 8,
    "seq": 512,
    "heads": 8,
}
#: On CPU: small enough that 2 and 4 ranks on 2 cores train in seconds.
CPU_DEFAULTS = {
    "tokens": 256,
    "hidden": 64,
    "experts": 8,
    "topk": 2,
    "layers": 2,
    "steps": 8,
    "seq": 64,
    "heads": 4,
}
#: The synthetic task's vocabulary (``model.batch_of``): small, so the loss falls in a few steps.
VOCAB = 64
#: The experts' inner width, in multiples of the hidden size.
FFN_FACTOR = 2

#: One bf16 rounding, relative: bf16 keeps 8 significant bits.
BF16_ROUNDING = 2.0**-8
#: Exchanges per MoE layer on a step's path from a parameter to the loss: the combine in the
#: forward and dispatch's backward (itself a combine) in the backward.
EXCHANGES_PER_LAYER = 2
#: Steps the bytes of live tensors must grow at, one after another, to count as a leak (after
#: the first step, whose optimizer state is new), and by at least this many bytes each (the
#: counts are exact on both devices: a correct training is flat).
LEAK_STEPS = 4
LEAK_BYTES = 1024


def agreement_bound(layers: int) -> float:
    """The relative bound on loss, gradient norm and gradient of the backend against the
    fallback at the same weights and batch (docs/probes.md, "check-train", derives it): every
    value an exchange returns is a sum the two may add in different orders, rounded once to
    bf16, so within one bf16 rounding; a step's path crosses ``EXCHANGES_PER_LAYER`` of them
    per MoE layer."""
    return EXCHANGES_PER_LAYER * layers * BF16_ROUNDING


def trajectory_bound(layers: int, step: int) -> float:
    """The relative bound on the loss of two independent trainings at ``step`` (0-based): the
    agreement bound once per step taken, since each step's weights carry the differences of
    every step before it (first order: they add)."""
    return agreement_bound(layers) * (step + 1)


#: What a recompute's dispatch can find against its forward's, from harmless to worst. The
#: first three are the same rows: a backend may return them so (the rows "in any order"), and
#: the backward is right when each layer's handle follows its rows.
FINDINGS = (
    "same",
    "reordered",
    "slots",
    "weights",
    "experts",
    "token_rows",
    "counts",
    "rows",
)
LEGAL = frozenset(FINDINGS[:3])

#: Each finding as the recompute step says it ("the recompute's dispatch returned ...").
FINDING_TEXT = {
    "same": "the rows of its forward in its forward's order",
    "reordered": "the rows of its forward in another order",
    "slots": "the same rows, top-k slots inside rows in another order",
    "weights": "the same rows and experts with other weights (bits)",
    "experts": "the same token rows routed to other experts",
    "token_rows": "other token rows",
    "counts": "other counts per expert than its forward",
    "rows": "{found} rows where its forward got {was}",
}

#: The speed's protocol (``loop.time_alike``): pairs of steps, one the backend's and one the
#: fallback's, first untimed to warm up, then timed.
SPEED_WARMUP_PAIRS = 2
SPEED_PAIRS = 6

#: AdamW's default learning rate times the hidden size: 1e-2 at hidden 64 (the CPU model).
LR_TIMES_HIDDEN = 0.64
#: The largest --lr taken. Adam moves every weight by about the rate at each step whatever its
#: gradient, and no weight of the model starts wider than 1 (the embedding's std; the others'
#: is hidden^-0.5): above 1 the first step swamps every weight with its own update, so nothing
#: the model could learn survives it (at 1 the CPU model's loss went 4.9 -> 34 in 8 steps, and
#: past float32's range AdamW itself raises).
MAX_LR = 1.0


def lr_for(hidden: int, given: float | None = None) -> float:
    """The learning rate: ``given``, else one that shrinks with the width. Adam moves every
    weight by about the learning rate per step whatever its gradient, so a fixed rate that
    suits hidden 64 makes hidden 1024 learn the task in one step and then diverge (measured
    on an H200: loss 4.7 -> 0.006 -> 8.8 over 8 steps at 1e-2)."""
    return given if given is not None else LR_TIMES_HIDDEN / hidden


@dataclasses.dataclass(frozen=True)
class TrainOptions(RunOptions):
    """check_train's command line, checked (``cli.parse_options``)."""

    layers: int | None
    steps: int | None
    seq: int | None
    heads: int | None
    lr: float | None  # None: lr_for(hidden)
    checkpoint: bool  # non-reentrant activation checkpointing around each layer
    recompute: str  # dispatch | cached: what the recompute asks of the backend
    te: str  # auto | on | off
    all_backends: bool
    prefix: str | None  # where --all-backends finds the venvs
