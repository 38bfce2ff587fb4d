"""check_ep's precision step: random tokens and router-like weights against an fp32
reference, at DeepEP's bounds.

Why these tests: every other check's inputs make the right answer exact in bf16, so a backend
whose arithmetic is right only for such values passed every step: one that keeps a token's
running sum in bf16, one that carries the top-k weights in bf16. Each is the torch reference
with that one fault (tests/fixtures/broken_backends.py), run on real gloo groups; it must fail
the precision step and nothing else. The reference backend, which sums in fp32 and rounds once
as DeepEP's kernels do, passes. In-process tests hold the reference's own promises: DeepEP's
calc_diff, offsets that cancel per node in whatever order a backend adds them, and a bf16
running sum failing the bound in every order while an fp32 one passes.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from conftest import BROKEN

SMALL = ["--tokens", "64", "--hidden", "64", "--experts", "16", "--topk", "4"]
QUICK = ["--iters", "3", "--warmup", "1", "--replays", "2", "--timeout", "120"]


def backend(cls: str) -> list[str]:
    return ["--backend-class", f"{BROKEN}:{cls}"]


@pytest.mark.parametrize(
    ("cls", "world", "phrase"),
    [
        # Three or more ranks per token: with two, one bf16 rounding of the pair is all an
        # fp32 sum rounded once does too (the same bits, and no harm; see the next test).
        ("AccumulatesCombineInTokenDtype", 3, "combine with cancelling offsets: calc_diff "),
        ("AccumulatesCombineInTokenDtype", 4, "combine with cancelling offsets: calc_diff "),
        ("TopkWeightsInBfloat16", 2, "received tokens carry wrong top-k weights (calc_diff "),
    ],
)
def test_a_backend_right_only_for_exact_inputs_fails_precision_alone(
    check_ep, cls: str, world: int, phrase: str
) -> None:
    # 16 experts do not split over 3 ranks: 12 do (4 a rank, top-4 reaches all 3 often).
    shape = [*SMALL[:4], "--experts", "12", *SMALL[6:]] if world == 3 else SMALL
    run = check_ep(*backend(cls), *shape, *QUICK, "--dtype", "bfloat16", nproc=world)
    assert run.proc.returncode == 1, run.output
    statuses = run.statuses()
    assert [n for n, s in statuses.items() if s != "pass"] == ["precision"], statuses
    step = run.step("precision")
    assert phrase in step["detail"], step["detail"]
    assert "the backend is right for exact inputs only" in step["hint"]
    if cls == "AccumulatesCombineInTokenDtype":
        diffs = step["data"]["calc_diff"]
        assert diffs["combine with cancelling offsets"] > 5e-6 * 10, diffs
        assert "dispatch_backward with cancelling offsets: calc_diff" in step["detail"]
    else:
        assert "> 1e-09" in step["detail"]


def test_at_two_ranks_a_bf16_running_sum_passes_and_the_step_says_it_went_unchecked(
    check_ep,
) -> None:
    """At two ranks a token's combine adds two rows at most, and their sum is rounded once
    whether it is kept in bf16 or fp32: the fault cannot change a bit, so it passes (and does
    no harm there). The step must not let that pass for a check: it says accumulation precision
    went unchecked and names the run that checks it (the 3- and 4-rank cases above fail)."""
    run = check_ep(
        *backend("AccumulatesCombineInTokenDtype"), *SMALL, *QUICK, "--dtype", "bfloat16", nproc=2
    )
    assert run.proc.returncode == 0, run.output
    step = run.step("precision")
    assert step["status"] == "pass"
    detail = step["detail"]
    assert "accumulation precision unchecked: no token reaches more than 2 ranks of one node" in (
        detail
    ), detail
    assert "is rounded once whether the backend keeps it in that dtype or in fp32" in detail
    assert "checked with 4 ranks (on one GPU: --nproc-per-node 4 --ranks-per-gpu 4)" in detail
    assert step["data"]["accumulation_checked"] is False
    assert step["data"]["ranks_a_token_reaches"] == 2
    assert run.report["numbers"]["precision_accumulation_checked"] is False


def test_the_reference_sums_in_fp32_and_passes_at_deepeps_bounds(check_ep) -> None:
    run = check_ep("--backend", "torch", *SMALL, *QUICK, "--dtype", "bfloat16", nproc=4)
    assert run.proc.returncode == 0, run.output
    step = run.step("precision")
    assert step["status"] == "pass"
    diffs = step["data"]["max_calc_diff"]
    # Random bf16 tokens: one rounding of an fp32 sum, below the bound but not 0.
    assert 0 < diffs["combine"] < 5e-6, diffs
    # With cancelling offsets the exact sum is representable: rounded once, it is exact.
    assert diffs["combine with cancelling offsets"] == 0.0, diffs
    assert diffs["dispatch_backward with cancelling offsets"] == 0.0, diffs
    assert step["data"]["max_weights_calc_diff"] == 0.0
    numbers = run.report["numbers"]
    assert numbers["precision_calc_diff"] == diffs
    # Top-4 over 4 ranks: tokens reach 3 and 4 ranks, so a bf16 running sum would show.
    assert step["data"]["accumulation_checked"] is True
    assert "unchecked" not in step["detail"]
    assert numbers["precision_accumulation_checked"] is True


# ---------------------------------------------------------------------------------------
# The reference's own promises, in-process
# ---------------------------------------------------------------------------------------


def test_calc_diff_is_deepeps() -> None:
    from ep_image.probes.check_ep.reference.precision import calc_diff

    x = torch.tensor([1.0, 2.0, 3.0])
    y = torch.tensor([1.0, 2.0, 3.5])
    deepep = 1 - 2 * float((x.double() * y.double()).sum()) / float(
        (x.double() ** 2 + y.double() ** 2).sum()
    )
    assert calc_diff(x, y) == pytest.approx(deepep, rel=1e-12)
    assert calc_diff(x, x) == 0.0
    assert calc_diff(x, torch.tensor([1.0, float("nan"), 3.0])) == float("inf")
    assert calc_diff(x, x[:2]) == float("inf")


def _routing(tokens: int, experts: int, topk: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand((tokens, experts), generator=gen).topk(topk, dim=1).indices


@pytest.mark.parametrize(
    ("world", "nodes", "topk"), [(2, 1, 4), (4, 1, 4), (8, 1, 8), (8, 2, 8), (16, 2, 8)]
)
def test_offsets_cancel_within_each_node_and_no_partial_sum_does(
    world: int, nodes: int, topk: int
) -> None:
    """Every token's offsets sum to 0 over the ranks of each node that receive it, and every
    sum of some (two or more) but not all of them is at least one offset from 0: a running sum
    meets them in any order a backend chooses."""
    from ep_image.probes.check_ep.reference.precision import cancelling_offsets

    local = 4
    idx = _routing(128, world * local, topk, seed=world + nodes)
    gids = torch.arange(128) + 1000
    node_of_rank = [r * nodes // world for r in range(world)]
    sigma = torch.stack(
        [cancelling_offsets(idx, gids, r, local, node_of_rank) for r in range(world)], dim=1
    )
    owner = idx // local
    checked = 0
    for t in range(idx.shape[0]):
        receives = {int(q) for q in owner[t]}
        for node in set(node_of_rank):
            members = [r for r in sorted(receives) if node_of_rank[r] == node]
            values = [int(sigma[t, r]) for r in members]
            assert sum(values) == 0, (t, members, values)
            for k in range(2, len(values)):
                for subset in itertools.combinations(values, k):
                    assert sum(subset) != 0, (t, members, values, subset)
                    checked += 1
        assert all(int(sigma[t, r]) == 0 for r in range(world) if r not in receives)
    assert checked or world == 2


def _contributions(world: int, dtype: torch.dtype, cancel: bool) -> list[torch.Tensor]:
    """Every rank's stand-in output for one rank's random tokens, as combine receives them."""
    from ep_image.probes._adapters.base import Shape
    from ep_image.probes.check_ep.reference.inputs import expert_scales
    from ep_image.probes.check_ep.reference.precision import contribution, make_random_inputs

    local = 2
    shape = Shape(256, 128, world * local, min(8, world * local), dtype, torch.device("cpu"))
    inp = make_random_inputs(shape, 0, seed=7)
    gids = torch.arange(shape.tokens)
    scales = expert_scales(shape.experts, shape.device)
    nodes = [0] * world
    return [
        contribution(inp.x, inp.topk_idx, inp.topk_weights, gids, r, local, scales, nodes, cancel)
        for r in range(world)
    ]


@pytest.mark.parametrize("world", [3, 4, 8])
def test_a_bf16_running_sum_fails_in_any_order_and_an_fp32_one_passes(world: int) -> None:
    """What a kernel may do: add the ranks' rows in any order, in fp32 then round once (DeepEP),
    or round every partial sum to bf16 (the fault). Only the second fails the bound."""
    from ep_image.probes.check_ep.reference.precision import COMBINE_BOUND, calc_diff

    parts = _contributions(world, torch.bfloat16, cancel=True)
    exact = sum(p.double() for p in parts)
    orders = list(itertools.permutations(range(world)))
    for order in random.Random(world).sample(orders, min(len(orders), 12)):
        fp32 = torch.zeros_like(parts[0], dtype=torch.float32)
        bf16 = torch.zeros_like(parts[0])
        for r in order:
            fp32 = fp32 + parts[r].float()
            bf16 = bf16 + parts[r]
        assert calc_diff(fp32.to(torch.bfloat16).float(), exact.float()) <= COMBINE_BOUND
        assert calc_diff(bf16.float(), exact.float()) > 10 * COMBINE_BOUND, order
    plain = _contributions(world, torch.bfloat16, cancel=False)
    rounded_once = sum(p.float() for p in plain).to(torch.bfloat16)
    assert 0 < calc_diff(rounded_once.float(), sum(p.double() for p in plain).float()) < 5e-6


def _rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (float64) rounded once to ``dtype``, to nearest with ties to even, computed from the
    format's precision and range alone (torch's own conversions go through float32)."""
    info = torch.finfo(dtype)
    digits = {torch.bfloat16: 8, torch.float16: 11}[dtype]
    _, exponent = torch.frexp(x)  # |x| = m * 2**exponent, m in [0.5, 1)
    binade = torch.clamp(exponent - 1, min=math.frexp(info.smallest_normal)[1] - 1)
    spacing = torch.pow(2.0, (binade - (digits - 1)).double())
    out = torch.round(x / spacing) * spacing  # torch.round: halves to even
    overflow = info.max + 2.0 ** (math.frexp(info.max)[1] - 1 - digits)  # max + half its spacing
    out = torch.where(out.abs() >= overflow, torch.copysign(torch.full_like(x, math.inf), x), out)
    return out.to(dtype)  # exact: out is a value of the format


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_sum_of_two_rows_has_the_same_bits_kept_in_the_dtype_or_in_fp32(
    dtype: torch.dtype,
) -> None:
    """The step the two-rank proof rests on (docs/probes.md, "Precision"): for a and b of the
    tokens' dtype, a running sum kept in that dtype (0 + a, then + b) and an fp32 sum rounded
    once both equal a + b rounded once, for every finite b of the format against edge and
    random a (largest finite, smallest subnormal, powers of two, halfway cases, both signs)."""
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    finite = every[torch.isfinite(every.float())]
    info = torch.finfo(dtype)
    edges = [info.max, info.tiny, info.smallest_normal / 8, 1.0, 2.0**-8, 1.0 + info.eps,
             1.5 * info.eps, 0.0, 65504.0 if dtype == torch.float16 else 2.0**100]  # fmt: skip
    gen = torch.Generator().manual_seed(11)
    sample = finite[torch.randint(0, finite.numel(), (48,), generator=gen)]
    firsts = torch.cat([torch.tensor(edges + [-e for e in edges]).to(dtype), sample])
    for a in firsts:
        a_row = a.expand_as(finite)
        exact = _rounded(a_row.double() + finite.double(), dtype)  # exact sum, then one rounding
        kept = (torch.zeros_like(finite) + a_row) + finite  # the running sum in the dtype
        once = (a_row.float() + finite.float()).to(dtype)  # fp32, rounded once at the end
        assert bool((kept == exact).all()), float(a)
        assert bool((once == exact).all()), float(a)


def test_ranks_reached_is_the_most_ranks_of_one_node_a_token_reaches() -> None:
    """The condition the step's "accumulation precision unchecked" note rests on."""
    from ep_image.probes.check_ep.reference.precision import ranks_reached

    # 4 ranks of 2 experts: token 0 reaches ranks 0 and 1, token 1 ranks 0, 1 and 3.
    idx = torch.tensor([[0, 2, -1], [1, 3, 7]])
    assert ranks_reached(idx, 2, [0, 0, 0, 0]) == 3
    # Two nodes of two ranks: no token reaches more than 2 ranks of one node.
    assert ranks_reached(idx, 2, [0, 0, 1, 1]) == 2
    assert ranks_reached(torch.full((3, 2), -1), 2, [0, 0]) == 0
