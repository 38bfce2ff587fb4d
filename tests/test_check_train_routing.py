"""check_train's model replays the forward's routing in its recompute.

On an H100 a router recomputed in the backward chose another expert for one token in 4096, and
torch's checkpoint ended the all-gather fallback's training with ``CheckpointError`` (other
shapes than the forward's). Played here with check_train's own model on the CPU, one rank,
its experts called directly: the router's weights moved between the forward and the backward
make the recompute choose other experts, as that drift did.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.utils.checkpoint import CheckpointError  # noqa: E402

from ep_image.probes.check_train import routing  # noqa: E402
from ep_image.probes.check_train.model import ModelShape, MoETransformer, batch_of  # noqa: E402

SHAPE = ModelShape(tokens=256, hidden=64, experts=8, topk=2, layers=2, seq=64, heads=4)


def a_model() -> MoETransformer:
    return MoETransformer(SHAPE, seed=3, rank=0, world=1, device=torch.device("cpu"))


def experts_of(model: MoETransformer):
    """One rank holds every expert: the exchange is the experts themselves."""
    return lambda tokens, idx, weights, layer: model.blocks[layer].experts(tokens, idx, weights)


def gradients(model: MoETransformer, checkpointed: bool, move_router: bool = False) -> list:
    model.zero_grad(set_to_none=True)
    model.routing = routing.RoutingReplay()
    inputs, _ = batch_of(SHAPE, 3, 0, 0)
    logits = model(inputs, experts_of(model), torch.bfloat16, checkpointed)
    if move_router:  # what the recompute's router then computes differs from the forward's
        with torch.no_grad():
            for block in model.blocks:
                block.router.add_(torch.randn_like(block.router) * 0.5)
    logits.float().pow(2).mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_a_recompute_without_drift_moves_nothing_and_matches_no_checkpoint_bit_for_bit() -> None:
    model = a_model()
    plain = gradients(model, checkpointed=False)
    again = gradients(model, checkpointed=True)
    assert model.routing.summary() == {"recomputes": 2, "tokens_moved": 0, "score_drift": 0.0}
    assert all(torch.equal(a, b) for a, b in zip(plain, again, strict=True))


def test_a_router_that_moves_in_the_recompute_is_replayed_and_counted() -> None:
    model = a_model()
    gradients(model, checkpointed=True, move_router=True)
    found = model.routing.summary()
    assert found["recomputes"] == 2 and found["tokens_moved"] > 0 and found["score_drift"] > 0
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_without_the_replay_the_same_drift_is_torchs_checkpoint_error(monkeypatch) -> None:
    """What the replay prevents (the test above cannot pass by the drift being too small)."""

    replayed = routing.RoutingReplay.route

    def fresh_choice(self, layer, logits, topk):
        self.chosen.clear()  # every routing is a forward's: the recompute chooses afresh
        return replayed(self, layer, logits, topk)

    monkeypatch.setattr(routing.RoutingReplay, "route", fresh_choice)
    model = a_model()
    with pytest.raises(CheckpointError, match="different metadata"):
        gradients(model, checkpointed=True, move_router=True)
