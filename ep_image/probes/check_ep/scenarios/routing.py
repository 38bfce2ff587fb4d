"""The routings of the scenarios that are not uniform: one hot expert and idle ones (skewed),
top-k slots that route nowhere (dropped), every way a router marks a slot (marks).

Why this module exists: these are the routings training produces that one uniform layout never
shows; each is reproducible from the scenario's seed, generated on the CPU.
"""

from __future__ import annotations

import torch

from ep_image.probes._adapters.base import Shape
from ep_image.probes.check_ep.reference.inputs import Router, uniform_routing
from ep_image.probes.check_ep.scenarios.catalogue import Scenario


def skewed_routing(experts: int, topk: int, world: int) -> Router:
    """Expert ``hot[0]`` takes every token, the other hot experts 3 tokens in 4; the last rank
    (with 2+ ranks, where enough experts remain) and every third other expert take none."""
    local = experts // world
    candidates = list(range(experts))
    if world > 1 and experts - local >= topk:
        candidates = [e for e in candidates if e // local != world - 1]
    hot_count = max(1, min(topk // 4 or 1, len(candidates)))
    step = max(1, len(candidates) // hot_count)
    hot = candidates[::step][:hot_count]
    rest = [e for e in candidates if e not in hot]
    cold_extra = rest[2::3]
    while len(candidates) - len(cold_extra) < topk and cold_extra:
        cold_extra.pop()
    usable = [e for e in candidates if e not in cold_extra]

    def route(gen: torch.Generator, tokens: int) -> torch.Tensor:
        scores = torch.rand((tokens, experts), generator=gen)
        blocked = torch.ones(experts, dtype=torch.bool)
        blocked[usable] = False
        scores[:, blocked] = -1.0
        scores[:, hot[0]] = 3.0
        if len(hot) > 1:
            most = torch.rand((tokens, 1), generator=gen) < 0.75
            scores[:, hot[1:]] = torch.where(most, 2.0, scores[:, hot[1:]])
        return scores.topk(topk, dim=1).indices.to(torch.int64)

    return route


def dropped_routing(experts: int, topk: int) -> Router:
    """Uniform routing with a quarter of the slots -1 and every eighth token's slots all -1
    (token 0 keeps exactly one expert)."""

    def route(gen: torch.Generator, tokens: int) -> torch.Tensor:
        idx = uniform_routing(gen, tokens, experts, topk)
        drop = torch.rand(idx.shape, generator=gen) < 0.25
        drop[7::8] = True
        if tokens:
            drop[0] = True
            drop[0, 0] = False
        return torch.where(drop, torch.full_like(idx, -1), idx)

    return route


def marks_routing(experts: int, topk: int) -> Router:
    """Uniform routing with slots marked every way a router does, by token: every fourth token
    drops its first slot (-1), the next its last, the next every slot, the fourth keeps all
    (which slots carry weight 0 is ``zero_weights``)."""

    def route(gen: torch.Generator, tokens: int) -> torch.Tensor:
        idx = uniform_routing(gen, tokens, experts, topk)
        kind = torch.arange(tokens) % 4
        idx[kind == 0, 0] = -1
        idx[kind == 1, -1] = -1
        idx[kind == 2] = -1
        return idx

    return route


def zero_weights(topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """``topk_weights`` with weight 0 on valid slots (a router's zero gate): of every token
    that keeps all its slots, the last slot, and of every third token its first valid slot."""
    weights = topk_weights.clone()
    valid = topk_idx >= 0
    whole = valid.all(dim=1)
    weights[whole, -1] = 0.0
    first = valid.int().argmax(dim=1)
    every_third = (torch.arange(topk_idx.shape[0], device=topk_idx.device) % 3 == 0) & valid.any(1)
    rows = every_third.nonzero().squeeze(1)
    weights[rows, first[rows]] = 0.0
    return weights


def router_of(scenario: Scenario, shape: Shape, world: int) -> Router | None:
    if scenario.routing == "skewed":
        return skewed_routing(shape.experts, shape.topk, world)
    if scenario.routing == "dropped":
        return dropped_routing(shape.experts, shape.topk)
    if scenario.routing == "marks":
        return marks_routing(shape.experts, shape.topk)
    return None
