"""What a training framework does with its own tensors around each backend call, for the
``views`` scenario: it hands over views, and it reuses its memory once a call returns.

Why this module exists: a framework passes a backend slices of wider activations and transposed
views (not fresh contiguous tensors), and reuses its buffers as soon as a call returns: its
inputs are overwritten by the next layer, and the outputs it got back are its own to write
over. A backend that reads a view as if it were contiguous, writes into its caller's inputs,
returns or keeps a view of them, or reads back later from what it returned, is right for fresh
tensors only. Each call through :class:`Caller` checks all four.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ep_image.probes.check_ep.reference import same_values

#: What the caller writes over its memory with: far from every value the probe sends.
JUNK_FLOAT = 7.0
JUNK_INT = -7


def _junk(t: torch.Tensor) -> float | int:
    return JUNK_FLOAT if t.is_floating_point() else JUNK_INT


def as_view(t: torch.Tensor, transpose: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``t``'s values in a non-contiguous view, and the memory behind it: a column slice of a
    wider tensor, or (``transpose``) the transpose of a transposed copy."""
    if t.dim() != 2:
        return t.clone(), t
    if transpose:
        base = t.t().contiguous()
        return base.t(), base
    base = torch.full((t.shape[0], t.shape[1] + 3), _junk(t), dtype=t.dtype, device=t.device)
    view = base[:, : t.shape[1]]
    view.copy_(t)
    return view, base


def _outputs(out: Any) -> list[torch.Tensor]:
    """The tensors a backend call returned (a Dispatched's rows, routing and weights)."""
    if isinstance(out, torch.Tensor):
        return [out]
    found = [getattr(out, n, None) for n in ("recv_x", "recv_topk_idx", "recv_topk_weights")]
    return [t for t in found if isinstance(t, torch.Tensor)]


@dataclasses.dataclass
class Caller:
    """Hands a backend views of its inputs and reuses its memory after each call; the problems
    found go to ``check(where, ...)`` like every other comparison of the scenario."""

    call: Callable[..., Any]  # Run.call: the backend call, with its breadcrumb
    check: Callable[..., None]  # Run.check: record a comparison's problems
    calls: int = 0

    def __call__(self, where: str, fn: Callable[..., Any], *args: Any) -> Any:
        self.calls += 1
        handed: list[Any] = []
        bases: list[torch.Tensor] = []
        sent: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, arg in enumerate(args):
            if isinstance(arg, torch.Tensor) and arg.dim() == 2:
                view, base = as_view(arg, transpose=(self.calls + i) % 2 == 1)
                handed.append(view)
                bases.append(base)
                sent.append((view, arg.clone()))
            else:
                handed.append(arg)
        out = self.call(where, fn, *handed)
        self.check(where, _inputs_kept, sent)
        kept = [t.clone() for t in _outputs(out)]
        for base in bases:  # the caller's next layer writes its activations over them
            base.fill_(_junk(base))
        self.check(where, _outputs_kept, _outputs(out), kept)
        return out

    @staticmethod
    def reuse(t: Any) -> None:
        """The caller writes over a tensor the backend gave it, now that it has read it."""
        if isinstance(t, torch.Tensor) and t.numel():
            t.fill_(_junk(t))


def _inputs_kept(sent: list[tuple[torch.Tensor, torch.Tensor]]) -> list[str]:
    """The views the caller handed over still hold what it sent: the backend wrote nothing into
    its caller's tensors."""
    changed = [i for i, (view, before) in enumerate(sent) if not same_values(view, before)]
    if not changed:
        return []
    return [
        f"the call wrote into its caller's input {changed} (a framework's activations and "
        "routing are its own: a backend must not change them)"
    ]


def _outputs_kept(now: list[torch.Tensor], kept: list[torch.Tensor]) -> list[str]:
    """What the call returned did not change when the caller overwrote its own inputs."""
    if all(same_values(a, b) for a, b in zip(now, kept, strict=True)):
        return []
    return [
        "what the call returned changed when its caller overwrote its own input tensors: the "
        "backend returned (or reads from) a view of its caller's memory"
    ]
