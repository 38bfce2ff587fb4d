"""The router's choice under activation checkpointing: the forward's, replayed by its recompute.

Why this module exists: on an H100, a router recomputed in the backward chose another expert
for one token in 4096 whose scores nearly tied (in DeepEP v2's process, in the all-gather
fallback's training too), and torch's checkpoint then ends in ``CheckpointError`` (other
shapes than the forward's) whatever exchanges the tokens. Recomputing an MoE layer is sound
only with the forward's routing; replaying it holds the backend's recompute on the forward's
inputs, and the tokens whose choice moved are counted (on the device, read once per
training) so that the report can name the drift.
"""

from __future__ import annotations

import torch


class RoutingReplay:
    """Per pass and layer, the forward's top-k experts and scores; a second routing of the
    layer in the same pass (its recompute) takes the forward's experts, weighted by the
    recompute's own scores at them (the gradient reaches the router as in the forward)."""

    def __init__(self) -> None:
        self.chosen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.moved: torch.Tensor | None = None  # tokens whose recomputed choice differed
        self.drift: torch.Tensor | None = None  # largest change of a chosen score
        self.recomputes = 0

    def begin(self) -> None:
        """A new pass: the forward routes afresh."""
        self.chosen.clear()

    def route(self, layer: int, logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, ...]:
        """``(idx, weights)`` of ``logits`` [T, E]: the top-k (the forward), or the forward's
        experts (its recompute); weights are the softmax over the chosen scores (fp32)."""
        # The choice is not differentiated (as topk's own backward is not, but for the
        # values): both passes then run the same differentiable ops, gather and softmax, and
        # save tensors of the same shapes, which torch's checkpoint holds them to.
        idx = logits.detach().topk(topk, dim=-1).indices
        if layer not in self.chosen:
            scores = logits.gather(-1, idx)
            self.chosen[layer] = (idx, scores.detach())
            return idx, torch.softmax(scores, dim=-1)
        first_idx, first_scores = self.chosen[layer]
        scores = logits.gather(-1, first_idx)
        moved = (idx != first_idx).any(dim=-1).sum()
        drift = (scores.detach() - first_scores).abs().max()
        self.moved = moved if self.moved is None else self.moved + moved
        self.drift = drift if self.drift is None else torch.maximum(self.drift, drift)
        self.recomputes += 1
        return first_idx, torch.softmax(scores, dim=-1)

    def summary(self) -> dict[str, float | int]:
        """Recomputed routings, the tokens whose choice moved in them and the largest change
        of a chosen score (one host read)."""
        moved = int(self.moved.item()) if self.moved is not None else 0
        drift = float(self.drift.item()) if self.drift is not None else 0.0
        return {"recomputes": self.recomputes, "tokens_moved": moved, "score_drift": drift}
