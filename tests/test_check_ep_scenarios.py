"""check_ep's scenarios and operation contracts, against backends with one fault each.

Why these tests: every layer-shape check drives one routing, so a backend right only for it
passed. Each scenario class gets a broken backend here (tests/fixtures/broken_backends.py:
the torch reference with one planted fault, right for the layer-shape routing) and the probe
must fail it in that scenario, named with its seed, and pass the others; the torch reference
passes every scenario at 1, 2 and 4 ranks (tests/test_check_ep.py). The inputs' exactness,
the scenario generators and the HybridEP routing-map translation are checked in-process.
"""

from __future__ import annotations

import pytest
import torch
from conftest import BROKEN

SMALL = ["--tokens", "64", "--hidden", "64", "--experts", "16", "--topk", "4"]
QUICK = ["--iters", "3", "--warmup", "1", "--replays", "2", "--timeout", "120"]


def all_scenarios() -> tuple[str, ...]:
    from ep_image.probes.check_ep.scenarios.catalogue import NAMES

    return NAMES


def backend(cls: str) -> list[str]:
    return ["--backend-class", f"{BROKEN}:{cls}"]


def scenario_results(run) -> dict[str, dict]:
    return {r["name"]: r for r in run.step("scenarios")["data"]["scenarios"]}


# ---------------------------------------------------------------------------------------
# One broken backend per scenario class: that scenario fails, named, and only the scenarios
# that drive the backend the same way fail with it
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "world", "failing", "phrase"),
    [
        # At one rank every layout delivers every token in order, so a stale layout hides.
        # Interleaved layouts run backward through an earlier layout's handle too.
        ("KeepsPreviousLayout", 2, ("changing", "interleaved"), "layout 2 combine_backward"),
        ("ReusesDispatchBuffer", 1, ("changing", "interleaved"), "layout 2 outputs: what dispatch"),
        ("DropsHotExpertTokens", 1, ("skewed",), "layout 0 dispatch: local expert"),
        # marks drops slots too (-1 in a token's first, last or every slot).
        ("MishandlesDroppedSlots", 1, ("dropped", "marks"), "layout 0 dispatch: received"),
        ("BreaksOnEmptyRank", 2, ("uneven",), "layout 0"),
        # views runs a round of new activations through each layout, as reuse does.
        ("KeepsFirstActivations", 1, ("reuse", "views"), "dispatch_cached (round 2)"),
        # How frameworks drive a backend.
        ("ReadsXAsContiguous", 2, ("views",), "layout 0 dispatch: received"),
        ("RoutingByReferenceInHandle", 2, ("views",), "dispatch_cached (round 1)"),
        ("CombineUsesLastHandle", 2, ("interleaved",), "layout 0 combine"),
        ("ExtraZeroRowsOnRedispatch", 1, ("recompute",), "layout 0 dispatch again: received"),
        ("StaleAfterRecreate", 1, ("lifecycle",), "layout 1 dispatch"),
        ("DropsZeroWeightSlots", 2, ("marks",), "layout 0 dispatch: received"),
    ],
)
def test_a_fault_of_one_scenario_class_fails_that_scenario(
    check_ep, cls: str, world: int, failing: tuple[str, ...], phrase: str
) -> None:
    from ep_image.probes.check_ep.scenarios.catalogue import scenario_seed

    run = check_ep(*backend(cls), *SMALL, *QUICK, nproc=world if world > 1 else 0)
    assert run.proc.returncode == 1, run.output
    statuses = run.statuses()
    assert [n for n, s in statuses.items() if s != "pass"] == ["scenarios"], statuses
    assert statuses["scenarios"] == "fail"
    results = scenario_results(run)
    assert {n: r["status"] for n, r in results.items()} == {
        n: "fail" if n in failing else "pass" for n in all_scenarios()
    }
    scenario = failing[0]  # the first in the documented order: the table names it first
    bad = results[scenario]
    assert bad["seed"] == scenario_seed(0, scenario)  # reproducible: recorded in the report
    assert phrase in bad["detail"], bad
    detail = run.step("scenarios")["detail"]
    assert detail.startswith(f"{scenario} failed on rank {bad['rank']} (seed {bad['seed']}): ")
    assert "--scenarios NAME" in run.step("scenarios")["hint"]
    assert run.report["numbers"]["scenarios"][scenario] == "fail"
    if cls == "ExtraZeroRowsOnRedispatch":  # the recompute's own words
        assert any("where its first dispatch returned" in p for p in bad["problems"]), bad
    if cls == "BreaksOnEmptyRank":  # the rank without tokens says what it lost
        assert bad["tokens_per_rank"] == [[59], [0]]
        rank1 = run.step("scenarios")["data"]["ranks"][1]["scenarios"]
        uneven = next(r for r in rank1 if r["name"] == "uneven")
        assert uneven["detail"].startswith("layout 0 dispatch: received 0 tokens, expected ")
        assert bad["failed_ranks"] == [0, 1]


def test_a_backend_writing_into_its_callers_input_is_named(check_ep) -> None:
    """It changes the probe's own inputs too, so many checks fail; views says what it did."""
    run = check_ep(*backend("WritesIntoCallerInput"), *SMALL, *QUICK, nproc=2)
    assert run.proc.returncode == 1, run.output
    views = scenario_results(run)["views"]
    assert views["status"] == "fail"
    assert any("the call wrote into its caller's input" in p for p in views["problems"]), views


def test_a_backend_answering_from_a_cache_fails_reuse_and_the_timed_loop(check_ep) -> None:
    """The timed calls each get new activations: a cached answer is wrong data, not a fast
    bandwidth."""
    run = check_ep(*backend("CachesResults"), *SMALL, *QUICK)
    assert run.proc.returncode == 1, run.output
    assert [n for n, s in run.statuses().items() if s != "pass"] == ["bandwidth", "scenarios"]
    # views runs a round of new activations through each layout too.
    assert {n: r["status"] for n, r in scenario_results(run).items()} == {
        n: "fail" if n in ("reuse", "views") else "pass" for n in all_scenarios()
    }
    band = run.step("bandwidth")
    assert "4 of 4 back-to-back dispatch calls returned wrong data" in band["detail"]
    assert "combine calls returned wrong data (calls [2, 3])" in band["detail"]
    assert "new activations" in band["detail"]


def test_backward_operations_are_checked_each_on_its_own(check_ep) -> None:
    """combine_backward x 2 and dispatch_backward x 0.5: the composite gradient is exact, the
    experts' gradient is not, and the probe says which operation is wrong."""
    run = check_ep(*backend("CompensatedBackward"), *SMALL, *QUICK)
    assert run.proc.returncode == 1, run.output
    statuses = run.statuses()
    assert statuses["dispatch_combine"] == "pass" and statuses["backward"] == "fail"
    detail = run.step("backward")["detail"]
    assert not detail.startswith("d/dx")  # the composite is not what failed
    assert detail.startswith("combine_backward (the gradient the experts get): 64 of 64 rows")
    assert "dispatch_backward (the gradient the tokens get): 64 of 64 tokens" in detail
    assert "the composite d/dx matches" in detail
    assert run.step("backward")["data"]["grad_rel_diff"] == 0.0
    # Every scenario checks both operations too (uneven holds no token at one rank).
    results = scenario_results(run)
    assert all(results[n]["status"] == "fail" for n in all_scenarios() if n != "uneven")
    assert "combine_backward" in results["changing"]["detail"]


def test_an_output_in_another_dtype_breaks_the_contract(check_ep) -> None:
    run = check_ep(*backend("CombineInFloat32"), *SMALL, *QUICK, "--dtype", "bfloat16")
    assert run.proc.returncode == 1, run.output
    dc = run.step("dispatch_combine")
    assert dc["status"] == "fail"
    assert dc["detail"] == "combine returned float32, its input was bfloat16"
    assert "dispatch_backward returned float32" in run.step("backward")["detail"]


def test_a_nan_in_one_combined_token_is_counted_and_named(check_ep) -> None:
    """It used to read "0 of 64 tokens differ ... (worst: token 32, relative difference nan)"."""
    run = check_ep(*backend("NaNInOneToken"), *SMALL, *QUICK)
    assert run.proc.returncode == 1, run.output
    dc = run.step("dispatch_combine")
    assert dc["status"] == "fail"
    assert dc["detail"].startswith("combine: 1 of 64 tokens differ from the top-k weighted sum")
    assert "first: token 32" in dc["detail"]
    assert "1 hold NaN or inf, first token 32" in dc["detail"]
    assert dc["data"]["tokens_not_finite"] == 1 and dc["data"]["tokens_over_tolerance"] == 1
    assert "nan" not in dc["detail"].lower().replace("nan or inf", "")


# ---------------------------------------------------------------------------------------
# Not applicable, raised, crashed, selected
# ---------------------------------------------------------------------------------------


def test_a_scenario_the_api_does_not_take_is_reported_not_applicable(check_ep) -> None:
    """Like HybridEP (one token count for every rank): said in the report, not skipped."""
    run = check_ep(*backend("EqualTokensOnly"), *SMALL, *QUICK, "--scenarios", "uneven,changing")
    assert run.proc.returncode == 0, run.output
    step = run.step("scenarios")
    assert step["status"] == "pass"
    assert step["data"]["selected"] == ["changing", "uneven"]  # documented order, once each
    results = scenario_results(run)
    assert results["changing"]["status"] == "pass"
    assert results["uneven"]["status"] == "not applicable"
    assert results["uneven"]["detail"] == (
        "not applicable to equal_tokens_only: its dispatch takes one token count for every rank"
    )
    assert "uneven not applicable to equal_tokens_only" in step["detail"]
    assert "scenarios changing, uneven (64 tokens/rank)" in run.proc.stdout


def test_a_backend_that_raises_in_a_scenario_stops_there(check_ep) -> None:
    run = check_ep(*backend("RaisesOnDroppedSlots"), *SMALL, *QUICK)
    assert run.proc.returncode == 3, run.output
    statuses = run.statuses()
    # scenarios is the last step: the bandwidth step before it kept its verdict.
    assert statuses["scenarios"] == "error" and statuses["bandwidth"] == "pass"
    results = scenario_results(run)
    assert [results[n]["status"] for n in all_scenarios()] == ["pass", "pass", "error"] + [
        "not run"
    ] * (len(all_scenarios()) - 3)
    assert results["dropped"]["detail"] == (
        "layout 0 dispatch raised IndexError: index -1 is out of bounds for dimension 1 with "
        "size 16"
    )


def test_a_crash_in_a_scenario_names_the_scenario_and_the_call(check_ep) -> None:
    run = check_ep(*backend("SegfaultsOnEmptyRank"), *SMALL, *QUICK)
    assert run.proc.returncode == 3, run.output
    step = run.step("scenarios")
    assert step["status"] == "error"
    assert (
        "died with SIGSEGV during scenarios (scenario uneven: layout 0 dispatch)"
        in (step["detail"])
    )
    # The scenarios that finished before the crash keep their verdicts.
    assert {r["name"]: r["status"] for r in step["data"]["scenarios"]} == {
        "changing": "pass",
        "skewed": "pass",
        "dropped": "pass",
        "uneven": "error",
    }


def test_scenario_names_parse() -> None:
    from ep_image.probes.check_ep.scenarios.catalogue import NAMES, parse

    assert (
        parse("all")
        == list(NAMES)
        == [
            "changing",
            "skewed",
            "dropped",
            "uneven",
            "reuse",
            "interleaved",
            "recompute",
            "lifecycle",
            "marks",
            "views",
        ]
    )
    assert parse("none") == []
    assert parse("reuse, skewed,reuse") == ["skewed", "reuse"]
    with pytest.raises(ValueError, match="unknown scenario 'x'; choose from changing"):
        parse("skewed,x")


# ---------------------------------------------------------------------------------------
# In-process: exact inputs, the generators, the contract checks, HybridEP's routing map
# ---------------------------------------------------------------------------------------


def _shape(tokens: int, hidden: int, experts: int, topk: int, dtype=torch.bfloat16):
    from ep_image.probes._adapters.base import Shape

    return Shape(tokens, hidden, experts, topk, dtype, torch.device("cpu"))


@pytest.mark.parametrize(("experts", "topk", "world"), [(256, 8, 8), (128, 8, 4), (64, 36, 2)])
def test_combined_tokens_are_exact_in_bf16_in_any_order(experts: int, topk: int, world: int):
    """Each rank's expert output rounded to bf16, summed in bf16 in a random order of ranks,
    equals the reference exactly: why the probe's bound is 0 (DeepEP's approach)."""
    from ep_image.probes.check_ep import reference as ref

    shape = _shape(256, 64, experts, topk)
    assert ref.exact(topk) and ref.tolerance_for(torch.bfloat16, topk) == 0.0
    inputs = ref.make_inputs(shape, rank=0, seed=5)
    scales = ref.expert_scales(experts, shape.device)
    local = experts // world
    parts = []
    for r in range(world):
        mine = (inputs.topk_idx >= r * local) & (inputs.topk_idx < (r + 1) * local)
        factor = (inputs.topk_weights * scales[inputs.topk_idx.clamp(min=0)] * mine).sum(1)
        parts.append(ref.expert_output(inputs.x, factor))  # bf16, as a rank sends it back
    want = ref.expected_combine(inputs, scales)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        total = torch.zeros_like(parts[0])
        for r in torch.randperm(world, generator=gen).tolist():
            total = total + parts[r]  # a bf16 sum
        assert torch.equal(total.float(), want)
    assert not ref.exact(37) and ref.tolerance_for(torch.bfloat16, 37) == 1e-2


def test_the_scenario_generators_make_what_they_promise() -> None:
    from ep_image.probes.check_ep import reference as ref
    from ep_image.probes.check_ep.scenarios.catalogue import BY_NAME, tokens_of
    from ep_image.probes.check_ep.scenarios.routing import dropped_routing, skewed_routing

    experts, topk, world, tokens = 32, 4, 4, 64
    gen = torch.Generator().manual_seed(0)
    idx = skewed_routing(experts, topk, world)(gen, tokens)
    load = torch.bincount(idx.flatten(), minlength=experts)
    assert int(load.max()) == tokens  # one expert receives every token
    assert int(load[(world - 1) * experts // world :].sum()) == 0  # the last rank: none
    assert int((load[: (world - 1) * experts // world] == 0).sum()) >= 3  # and some experts
    assert all(len(set(row)) == topk for row in idx.tolist())  # distinct experts per token

    idx = dropped_routing(experts, topk)(gen, tokens)
    assert bool((idx[7::8] == -1).all()) and int((idx[0] >= 0).sum()) == 1
    assert 0.3 < float((idx == -1).float().mean()) < 0.5
    inputs = ref.make_inputs(_shape(tokens, 16, experts, topk), 0, 0, route=lambda g, n: idx)
    assert bool((inputs.topk_weights[idx == -1] == 0).all())

    uneven = BY_NAME["uneven"]
    assert [tokens_of(uneven, 512, r, 4) for r in range(4)] == [507, 0, 512, 257]
    assert tokens_of(uneven, 512, 0, 1) == 0


def test_the_output_contract_names_dtype_shape_and_layout() -> None:
    from ep_image.probes.check_ep.reference import tensor_contract

    good = torch.zeros(4, 8, dtype=torch.bfloat16)
    cpu = torch.device("cpu")
    assert tensor_contract("combine", good, 4, 8, torch.bfloat16, cpu) == []
    assert tensor_contract("combine", good.float(), 4, 8, torch.bfloat16, cpu) == [
        "combine returned float32, its input was bfloat16"
    ]
    strided = good.t().contiguous().t()
    assert tensor_contract("dispatch", strided, 4, 8, torch.bfloat16, cpu) == [
        "dispatch returned a non-contiguous tensor (strides [1, 4])"
    ]
    assert (
        "shape [3, 8], expected [4, 8]"
        in tensor_contract("combine", good[:3], 4, 8, torch.bfloat16, cpu)[0]
    )


def test_hybridep_gets_dropped_slots_as_a_routing_map() -> None:
    """HybridEP's index API scatters topk_idx (-1 out of range); the adapter passes the
    routing map its dispatch also takes, equal to HybridEP's own indices_to_map elsewhere."""
    from ep_image.probes._adapters.hybrid_ep_buffer import HybridEPBackend, _topk_to_routing_map

    idx = torch.tensor([[0, 3], [-1, 2], [-1, -1]])
    w = torch.tensor([[0.25, 0.5], [0.75, 1.0], [0.5, 0.5]])
    routing, probs = _topk_to_routing_map(idx, w, experts=4)
    assert routing.tolist() == [
        [True, False, False, True],
        [False, False, True, False],
        [False, False, False, False],
    ]
    assert probs.tolist() == [[0.25, 0, 0, 0.5], [0, 0, 1.0, 0], [0, 0, 0, 0]]
    valid = idx[:1]  # what HybridEP's indices_to_map builds from valid indices
    ref_map = torch.zeros(1, 4, dtype=torch.bool).scatter(1, valid, 1)
    ref_probs = torch.zeros(1, 4).scatter(1, valid, w[:1])
    assert torch.equal(routing[:1], ref_map) and torch.equal(probs[:1], ref_probs)
    assert "uneven_tokens" in HybridEPBackend.input_limits
