"""Train the model for a few steps on one exchange and measure each step.

Why this module exists: a backend is judged by training, as its users judge it. Each phase
builds the model from the seed, so both start from the same weights, and trains it with AdamW
on the same batches: the fallback's phase is the oracle's trajectory and timing; the
backend's phase also evaluates, at every step and at the same weights and batch, the backend
without checkpointing and the fallback (untimed), so that every step's loss and gradient are
held against references that differ from it in one thing only.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ep_image.probes import _supervise
from ep_image.probes.check_train.model import ModelShape, MoETransformer, batch_of
from ep_image.probes.check_train.recompute import RecomputeMismatch
from ep_image.probes.check_train.types import SPEED_PAIRS, SPEED_WARMUP_PAIRS


@dataclasses.dataclass
class Phase:
    """What one phase needs: the model's shape and seed, where it runs, how it trains."""

    shape: ModelShape
    seed: int
    rank: int
    world: int
    device: torch.device
    dtype: torch.dtype
    group: Any  # the process group the gradients are summed over (the backend's)
    lr: float
    steps: int
    te: Any = None


@dataclasses.dataclass
class StepRecord:
    """One training step: the loss and gradient norm over all ranks, the seconds it took
    (the timed part only), the tensor bytes alive after it and its peak (GPU only)."""

    step: int
    loss: float
    grad_norm: float
    seconds: float
    live_bytes: int | None  # measured in the backend's phase only
    peak_bytes: int | None
    nonfinite: list[str] = dataclasses.field(default_factory=list)
    #: The references at this step's weights and batch: {"no_checkpoint"|"fallback":
    #: {"loss", "grad_norm", "loss_rel", "grad_norm_rel", "grad_rel"}}.
    references: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class PhaseResult:
    """A phase's steps, and how it ended early if it did."""

    steps: list[StepRecord] = dataclasses.field(default_factory=list)
    mismatch: str | None = None  # a recompute that got other rows (RecomputeMismatch)
    #: Both exchanges' step times measured alike (:func:`time_alike`); None where the
    #: backend's training ended early.
    timing: dict[str, Any] | None = None
    #: The recomputes' routing against their forwards' (``RoutingReplay.summary``).
    routing: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def losses(self) -> list[float]:
        return [s.loss for s in self.steps]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def live_bytes(device: torch.device) -> int:
    """Bytes held by live tensors now: the CUDA allocator's own count on a GPU; on the CPU,
    whose allocator counts nothing, the storages of every tensor Python can reach, each once
    (a backend that keeps a step's tensors keeps them reachable)."""
    gc.collect(1)
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    with warnings.catch_warnings():  # some objects warn when asked for their class
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    storages = {}
    for t in tensors:
        if t.device.type == "cpu" and not t.is_sparse:
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    storages.pop(0, None)
    return sum(storages.values())


class Trainer:
    """One phase's model, optimizer and the sums every step needs over the ranks."""

    def __init__(self, phase: Phase) -> None:
        self.phase = phase
        torch.manual_seed(phase.seed)
        self.model = MoETransformer(
            phase.shape, phase.seed, phase.rank, phase.world, phase.device, phase.te
        )
        experts = {id(p) for p in self.model.expert_parameters()}
        self.dense = [p for p in self.model.parameters() if id(p) not in experts]
        self.experts = self.model.expert_parameters()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=phase.lr, weight_decay=0.01)
        self.global_tokens = phase.shape.tokens * phase.world

    def experts_of(self, layer: int) -> Any:
        return self.model.blocks[layer].experts

    def forward_backward(self, step: int, moe: Callable[..., Any], checkpointed: bool) -> float:
        """One forward and backward on this step's batch; the dense weights' gradients summed
        over ranks (every rank holds them whole); the loss over all ranks."""
        p = self.phase
        self.optimizer.zero_grad(set_to_none=False)
        inputs, targets = (t.to(p.device) for t in batch_of(p.shape, p.seed, step, p.rank))
        logits = self.model(inputs, moe, p.dtype, checkpointed)
        loss = F.cross_entropy(
            logits.reshape(-1, p.shape.vocab), targets.reshape(-1), reduction="sum"
        ) / float(self.global_tokens)
        loss.backward()
        grads = [q.grad for q in self.dense]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=p.group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        total = loss.detach().reshape(1).clone()
        dist.all_reduce(total, group=p.group)
        return float(total.item())

    def gradient(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's gradients as two flat fp32 vectors: the dense ones (the same on every
        rank) and its experts' (its own)."""
        dense = torch.cat([q.grad.float().reshape(-1) for q in self.dense])
        own = torch.cat([q.grad.float().reshape(-1) for q in self.experts])
        return dense, own

    def norm_sq(self, dense: torch.Tensor, own: torch.Tensor) -> float:
        """Squared norm over all ranks of a gradient split as :meth:`gradient` splits it."""
        experts = own.pow(2).sum().reshape(1)
        dist.all_reduce(experts, group=self.phase.group)
        return float(dense.pow(2).sum() + experts.item())

    def restore(self, dense: torch.Tensor, own: torch.Tensor) -> None:
        """Put a gradient taken by :meth:`gradient` back into the weights' ``.grad``."""
        for params, flat in ((self.dense, dense), (self.experts, own)):
            offset = 0
            for q in params:
                q.grad.copy_(flat[offset : offset + q.numel()].view_as(q.grad))
                offset += q.numel()


def _finite_problems(flags: dict[tuple[str, int], torch.Tensor], step: int) -> list[str]:
    """The layers whose MoE output (forward) or input gradient (backward) held NaN or Inf."""
    what = {"forward": "output", "backward": "input gradient"}
    return [
        f"step {step}, layer {layer}: the MoE {what[where]} holds NaN or Inf"
        for (where, layer), ok in sorted(
            flags.items(), key=lambda kv: (kv[0][1], kv[0][0] != "forward")
        )
        if not bool(ok)
    ]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else (0.0 if a == b else math.inf)


def _begin(phase: Phase, label: str) -> float:
    """A step's start: its breadcrumb, the GPU's peak statistics reset, the device idle; the
    clock reading to time it from."""
    _supervise.progress.update(scenario=label)
    if phase.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(phase.device)
    _sync(phase.device)
    return time.perf_counter()


def _since(phase: Phase, start: float) -> float:
    """Seconds since ``start``, once the device finished what was queued."""
    _sync(phase.device)
    return time.perf_counter() - start


def _not_finite(step: int, loss: float, norm: float) -> list[str]:
    if math.isfinite(loss) and math.isfinite(norm):
        return []
    return [f"step {step}: loss {loss}, gradient norm {norm}"]


def train_fallback(
    phase: Phase, make_exchange: Callable[[Trainer], Any], checkpointed: bool
) -> PhaseResult:
    """The oracle's trajectory: the model trained with the all-gather fallback, each step
    timed whole (forward, backward, the gradients' sum, the optimizer step)."""
    trainer = Trainer(phase)
    moe = make_exchange(trainer)
    result = PhaseResult()
    for step in range(phase.steps):
        start = _begin(phase, f"fallback step {step}")
        loss = trainer.forward_backward(step, moe, checkpointed)
        trainer.optimizer.step()
        seconds = _since(phase, start)
        norm = math.sqrt(trainer.norm_sq(*trainer.gradient()))
        record = StepRecord(step, loss, norm, seconds, None, peak_bytes(phase))
        record.nonfinite = _not_finite(step, loss, norm)
        result.steps.append(record)
    result.routing = trainer.model.routing.summary()
    return result


def train_backend(
    phase: Phase,
    backend_exchange: Callable[[Trainer], Any],
    fallback_exchange: Callable[[Trainer], Any],
    checkpointed: bool,
) -> PhaseResult:
    """The backend's trajectory. Each step: forward and backward through the backend (with
    checkpointing when asked), timed with the optimizer step; then, untimed and at the same
    weights and batch, the backend without checkpointing and the fallback, each gradient held
    against the step's; then the optimizer steps on the step's own gradient."""
    trainer = Trainer(phase)
    moe = backend_exchange(trainer)
    fallback = fallback_exchange(trainer)
    result = PhaseResult()
    for step in range(phase.steps):
        moe.finite.clear()
        moe.begin(step, checking=checkpointed)
        start = _begin(phase, f"backend step {step}")
        try:
            loss = trainer.forward_backward(step, moe, checkpointed)
            seconds = _since(phase, start)
            moe.ledger.settle()  # the recomputes' hashes: one host sync, after the timed part
        except RecomputeMismatch as exc:
            result.mismatch = str(exc)
            result.routing = trainer.model.routing.summary()
            return result
        peak = peak_bytes(phase)
        nonfinite = _finite_problems(moe.finite, step)
        dense, own = trainer.gradient()
        norm_sq = trainer.norm_sq(dense, own)
        references = {}
        refs: list[tuple[str, Any]] = [("fallback", fallback)]
        if checkpointed:
            refs.insert(0, ("no_checkpoint", moe))
        for name, exchange in refs:
            _supervise.progress.update(scenario=f"backend step {step}: {name} at its weights")
            if exchange is moe:
                moe.begin(step, checking=False)
            ref_loss = trainer.forward_backward(step, exchange, False)
            ref_dense, ref_own = trainer.gradient()
            ref_sq = trainer.norm_sq(ref_dense, ref_own)
            diff_sq = trainer.norm_sq(dense - ref_dense, own - ref_own)
            references[name] = {
                "loss": ref_loss,
                "grad_norm": math.sqrt(ref_sq),
                "loss_rel": _rel(loss, ref_loss),
                "grad_norm_rel": _rel(math.sqrt(norm_sq), math.sqrt(ref_sq)),
                "grad_rel": math.sqrt(diff_sq / ref_sq) if ref_sq else math.inf,
            }
        trainer.restore(dense, own)
        del dense, own
        start = _begin(phase, f"backend step {step}: optimizer")
        trainer.optimizer.step()
        seconds += _since(phase, start)
        after = peak_bytes(phase)  # the optimizer's own peak, as the fallback's step counts it
        peak = max(peak, after) if peak is not None and after is not None else peak
        norm = math.sqrt(norm_sq)
        record = StepRecord(step, loss, norm, seconds, live_bytes(phase.device), peak, nonfinite)
        record.references = references
        record.nonfinite += _not_finite(step, loss, norm)
        result.steps.append(record)
    result.routing = trainer.model.routing.summary()
    result.timing = time_alike(trainer, moe, fallback, checkpointed)
    return result


def time_alike(trainer: Trainer, moe: Any, fallback: Any, checkpointed: bool) -> dict[str, Any]:
    """Both exchanges' step times, measured alike: whole training steps (forward, backward,
    the gradients' sum, AdamW) of one model on the same batches, the backend's and the
    fallback's in turn, which goes first swapped every pair, after the same warm-up pairs,
    the recompute unchecked. The trajectories' own step times are not alike: the first phase
    of a process warms up over several steps (the fallback's, at one rank on an H200: 208 ms at
    its second step, 91 ms at its sixth, where the backend's ran at 98 to 86 ms: "1.38x" for
    the same exchange), and the backend's steps carry the probe's checks."""
    phase = trainer.phase
    seconds: dict[str, list[float]] = {"backend": [], "fallback": []}
    first: list[str] = []
    for i in range(SPEED_WARMUP_PAIRS + SPEED_PAIRS):
        step = phase.steps + i
        pair = [("backend", moe), ("fallback", fallback)]
        if i % 2:
            pair.reverse()
        for name, exchange in pair:
            if exchange is moe:
                moe.begin(step, checking=False)
            start = _begin(phase, f"speed: {name}, pair {i}")
            trainer.forward_backward(step, exchange, checkpointed)
            trainer.optimizer.step()
            took = _since(phase, start)
            if i >= SPEED_WARMUP_PAIRS:
                seconds[name].append(took)
        if i >= SPEED_WARMUP_PAIRS:
            first.append(pair[0][0])
    return {
        "warmup_pairs": SPEED_WARMUP_PAIRS,
        "pairs": SPEED_PAIRS,
        "first": first,
        "backend_seconds": [round(t, 6) for t in seconds["backend"]],
        "fallback_seconds": [round(t, 6) for t in seconds["fallback"]],
    }


def peak_bytes(phase: Phase) -> int | None:
    """The step's peak of tensor bytes: torch's CUDA allocator keeps one (reset at the step's
    start), its CPU allocator none (None)."""
    if phase.device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_allocated(phase.device))
