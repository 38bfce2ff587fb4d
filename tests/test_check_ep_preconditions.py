"""check_ep against backends that refuse views: a precondition named beside the verdict, not a
failure; and a backend shown to return wrong numbers stays "failed" when it then raises or
crashes.

Why these tests: on H100 and H200, DeepEP v2 raised on a non-contiguous ``x`` in dispatch,
DeepEP v1 on a non-contiguous ``topk_idx``, and HybridEP ended its process with SIGABRT in
dispatch: the ``views`` scenario called each of them unusable (exit 3), and every scenario and
step after it "not run", though everything frameworks pass worked. The stand-ins
(tests/fixtures/precondition_backends.py) refuse views the same ways, on real gloo process
groups at 1, 2 and 4 ranks; a backend that reads a view wrongly, segfaults on one, or lost a
token before it raised or crashed must still fail.
"""

from __future__ import annotations

import pytest
from conftest import FIXTURES

from ep_image.probes._report import Status, Step, exit_code_of

PRECONDITION = FIXTURES / "precondition_backends.py"
SMALL = ["--tokens", "64", "--hidden", "64", "--experts", "16", "--topk", "4"]
QUICK = ["--iters", "3", "--warmup", "1", "--replays", "2", "--timeout", "120"]

#: The views the first call of ``views`` hands dispatch (the caller alternates the two kinds).
FIRST_CALL_VIEWS = ["x (transpose)", "topk_idx (column slice)", "topk_weights (transpose)"]
V2_ASSERT = "raises RuntimeError: Assertion `x.is_contiguous()` failed (elastic.cpp:412)"
V1_ASSERT = "raises RuntimeError: Assertion error deep_ep.cpp:397 'topk_idx.is_contiguous()'"


def backend(cls: str) -> list[str]:
    return ["--backend-class", f"{PRECONDITION}:{cls}"]


def scenario_statuses(run) -> dict[str, str]:
    return {r["name"]: r["status"] for r in run.step("scenarios")["data"]["scenarios"]}


def all_scenarios() -> tuple[str, ...]:
    from ep_image.probes.check_ep.scenarios.catalogue import NAMES

    return NAMES


@pytest.mark.parametrize(
    ("cls", "world", "tensors", "how"),
    [
        # Like DeepEP v2: raises on a strided x; each kind of view of x refused alone.
        ("RefusesStridedX", 1, ["x (column slice)", "x (transpose)"], V2_ASSERT),
        ("RefusesStridedX", 2, ["x (column slice)", "x (transpose)"], V2_ASSERT),
        ("RefusesStridedX", 4, ["x (column slice)", "x (transpose)"], V2_ASSERT),
        # Like DeepEP v1: raises on a strided topk_idx.
        (
            "RefusesStridedTopkIdx",
            1,
            ["topk_idx (column slice)", "topk_idx (transpose)"],
            V1_ASSERT,
        ),
        (
            "RefusesStridedTopkIdx",
            2,
            ["topk_idx (column slice)", "topk_idx (transpose)"],
            V1_ASSERT,
        ),
        (
            "RefusesStridedTopkIdx",
            4,
            ["topk_idx (column slice)", "topk_idx (transpose)"],
            V1_ASSERT,
        ),
        # Like HybridEP: SIGABRT inside dispatch, on every rank or on one.
        ("AbortsOnViews", 1, FIRST_CALL_VIEWS, "ended its process with SIGABRT"),
        ("AbortsOnViews", 2, FIRST_CALL_VIEWS, "ended its process with SIGABRT on ranks [0, 1]"),
        (
            "AbortsOnViews",
            4,
            FIRST_CALL_VIEWS,
            "ended its process with SIGABRT on ranks [0, 1, 2, 3]",
        ),
        (
            "AbortsOnViewsOnRankZero",
            2,
            FIRST_CALL_VIEWS,
            "ended its process with SIGABRT on rank 0",
        ),
        (
            "AbortsOnViewsOnRankZero",
            4,
            FIRST_CALL_VIEWS,
            "ended its process with SIGABRT on rank 0",
        ),
        ("AbortsOnViewsOnRankOne", 2, FIRST_CALL_VIEWS, "ended its process with SIGABRT on rank 1"),
        ("AbortsOnViewsOnRankOne", 4, FIRST_CALL_VIEWS, "ended its process with SIGABRT on rank 1"),
        # Ending the process another way: os._exit(1), sys.exit(1).
        ("ExitsOnViews", 2, FIRST_CALL_VIEWS, "ended its process with status 1 on ranks [0, 1]"),
        ("SysExitsOnViews", 1, ["x (column slice)", "x (transpose)"], "calls sys.exit(1)"),
    ],
)
def test_a_backend_that_refuses_views_passes_with_the_precondition_named(
    check_ep, cls: str, world: int, tensors: list[str], how: str
) -> None:
    run = check_ep(*backend(cls), *SMALL, *QUICK, nproc=world if world > 1 else 0)
    assert run.proc.returncode == 0, run.output
    assert run.report is not None and run.report["exit_code"] == 0, run.output
    assert run.report["result"] == "passed"
    # Every step keeps its verdict: nothing after the refusal was lost with it.
    assert set(run.statuses().values()) == {"pass"}, run.statuses()
    assert scenario_statuses(run) == {
        n: "refused" if n == "views" else "pass" for n in all_scenarios()
    }
    assert run.report["numbers"]["scenarios"]["views"] == "refused"
    alone = not how.startswith("ended its process")
    want = {"scenario": "views", "call": "dispatch", "tensors": tensors, "how": how}
    assert run.report["preconditions"] == [{**want, "alone": alone}], run.report["preconditions"]
    views = next(r for r in run.step("scenarios")["data"]["scenarios"] if r["name"] == "views")
    assert views["preconditions"] == run.report["preconditions"]
    detail = run.step("scenarios")["detail"]
    assert "9 passed on every rank: changing, skewed, dropped, uneven, reuse," in detail
    if alone:
        assert f"views refused: dispatch refuses views of {tensors[0].split()[0]} " in detail
        assert "the views it takes were checked" in detail
    else:
        assert f"views refused: dispatch {how} when handed views of x (transpose)" in detail
        assert "the rest of views was not run" in detail
    name = run.report["backend"]
    assert f"result: passed (exit 0); precondition: {name}'s dispatch " in run.proc.stdout
    assert run.proc.stdout.count("result: passed (exit 0)") == 1


def test_a_refused_view_leaves_the_views_it_takes_checked(check_ep) -> None:
    """It refuses a strided x and reads topk_weights as if contiguous: the refusal is named,
    and the views handed after it still find the wrong weights (exit 1)."""
    run = check_ep(*backend("RefusesStridedXAndReadsWeightsAsContiguous"), *SMALL, *QUICK, nproc=2)
    assert run.proc.returncode == 1, run.output
    assert run.step("scenarios")["status"] == "fail"
    statuses = scenario_statuses(run)
    assert statuses == {n: "fail" if n == "views" else "pass" for n in all_scenarios()}
    views = next(r for r in run.step("scenarios")["data"]["scenarios"] if r["name"] == "views")
    assert "carry wrong top-k weights" in views["detail"], views
    assert [p["tensors"] for p in run.report["preconditions"]] == [
        ["x (column slice)", "x (transpose)"]
    ]
    assert "result: failed (exit 1); precondition: " in run.proc.stdout


@pytest.mark.parametrize("world", [1, 2])
def test_a_memory_fault_on_a_view_is_still_unusable(check_ep, world: int) -> None:
    run = check_ep(*backend("SegfaultsOnViews"), *SMALL, *QUICK, nproc=world if world > 1 else 0)
    assert run.proc.returncode == 3, run.output
    assert run.report is not None and run.report["exit_code"] == 3
    step = run.step("scenarios")
    assert step["status"] == "error"
    assert (
        "died with SIGSEGV during scenarios (scenario views: layout 0 dispatch)" in (step["detail"])
    )
    assert "preconditions" not in run.report
    statuses = scenario_statuses(run)
    assert statuses == {n: "error" if n == "views" else "pass" for n in all_scenarios()}
    assert run.proc.stdout.count("result: unusable (exit 3)") == 1


@pytest.mark.parametrize(
    ("cls", "phrase"),
    [
        ("LosesATokenThenRaisesOnDroppedSlots", "dropped stopped on rank 0 (seed "),
        ("LosesATokenThenSegfaultsOnEmptyRank", "died with SIGSEGV during scenarios"),
    ],
)
def test_a_backend_that_lost_a_token_stays_failed_when_it_then_raises_or_crashes(
    check_ep, cls: str, phrase: str
) -> None:
    """Every check found the lost token (exit 1); a later scenario then raises or crashes in
    the backend. The steps say both; the verdict stays "failed"."""
    run = check_ep(*backend(cls), *SMALL, *QUICK)
    assert run.proc.returncode == 1, run.output
    assert run.report is not None and run.report["exit_code"] == 1
    assert run.report["result"] == "failed"
    statuses = run.statuses()
    assert statuses["dispatch_combine"] == "fail" and statuses["bandwidth"] == "fail"
    assert statuses["scenarios"] == "error"  # the crash or raise is still reported as such
    assert phrase in run.step("scenarios")["detail"], run.step("scenarios")
    assert run.proc.stdout.count("result: failed (exit 1)") == 1


def test_a_scenario_that_failed_keeps_the_verdict_when_a_later_one_raises(check_ep) -> None:
    """Right at the layer shape, wrong in changing, then raising in dropped: the scenarios
    step is an error, and the verdict is "failed" (wrong numbers came first)."""
    run = check_ep(*backend("KeepsPreviousLayoutThenRaisesOnDroppedSlots"), *SMALL, *QUICK, nproc=2)
    assert run.proc.returncode == 1, run.output
    statuses = run.statuses()
    assert [n for n, s in statuses.items() if s != "pass"] == ["scenarios"], statuses
    assert statuses["scenarios"] == "error"
    assert scenario_statuses(run)["changing"] == "fail"
    assert scenario_statuses(run)["dropped"] == "error"
    assert run.step("scenarios")["data"]["wrong_data"] is True
    assert run.proc.stdout.count("result: failed (exit 1)") == 1


def test_an_error_after_a_failed_check_is_exit_1_where_the_probe_says_so() -> None:
    """check_ep names its checking steps; a probe that names none (check_te: a cuDNN mismatch
    that then breaks a TE call is unusable) keeps exit 3."""
    fail, error = Step("dispatch_combine", Status.FAIL), Step("scenarios", Status.ERROR)
    judged = ("dispatch_combine", "scenarios")
    assert exit_code_of([fail, error], judged=judged) == 1
    assert exit_code_of([fail, error]) == 3
    assert exit_code_of([Step("import", Status.FAIL), error], judged=judged) == 3
    assert exit_code_of([error], judged=judged) == 3
    wrong_first = Step("scenarios", Status.ERROR, data={"wrong_data": True})
    assert exit_code_of([Step("dispatch_combine"), wrong_first], judged=judged) == 1
    assert exit_code_of([fail, Step("scenarios", Status.MISSING)], judged=judged) == 4


def test_only_a_process_that_ended_itself_in_views_states_a_precondition() -> None:
    """A memory fault, a hang or an error anywhere, or an abort outside views or between
    calls, is not a refusal."""
    from ep_image.probes.check_ep.scenarios.verdict import process_end_refusal

    views = {"call": "dispatch", "tensors": ["x (transpose)"]}
    abort = {
        "how": "signal",
        "signal": "SIGABRT",
        "scenario": "views: layout 0 dispatch",
        "call": "dispatch, call #90",
        "scenario_views": views,
    }
    assert process_end_refusal(abort, {0: abort}, 0)["how"] == "ended its process with SIGABRT"
    for change in (
        {"signal": "SIGSEGV"},
        {"signal": "SIGKILL"},
        {"how": "hang"},
        {"scenario": "uneven: layout 0 dispatch"},
        {"call": None},  # between calls: the probe's own code, not the backend's
        {"scenario_views": {"call": "dispatch", "tensors": []}},  # handed no view
    ):
        assert process_end_refusal({**abort, **change}, {0: abort}, 0) is None, change
    segv = {**abort, "signal": "SIGSEGV"}
    assert process_end_refusal(abort, {0: abort, 1: segv}, 0) is None
    stopped = {"how": "stopped"}
    found = process_end_refusal(abort, {0: abort, 1: stopped}, 0)
    assert found is not None and found["how"] == "ended its process with SIGABRT on rank 0"
