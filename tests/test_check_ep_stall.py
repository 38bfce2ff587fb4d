"""check_ep names a rank that stopped making progress in a step its peers finished, in seconds.

Why these tests: a backend that skips a collective on one rank (a memoized result) or hangs
there after its last collective leaves its peers waiting; before, only the collective timeout
ended such a run (300 s by default, 314-320 s to "unusable"). Each case here runs with the
default --timeout and must end well within it, naming the rank, the step and the backend call,
with exit 1 when the backend returned wrong data before the stall and 3 when it did not. Where
the ranks end up waiting in different collectives (one in the backend's, its peer in the
probe's barrier), none finishes the step: that one ended after 307 s as a hang (exit 3), named
by a frame of the probe's own error handling, though the backend had returned wrong data.
"""

from __future__ import annotations

import time
from pathlib import Path

from conftest import BROKEN, run_probe_in

from ep_image.probes._ranks import stall

SMALL = ["--tokens", "64", "--hidden", "64", "--experts", "16", "--topk", "4"]
QUICK = ["--iters", "3", "--warmup", "1", "--scenarios", "none"]


def run(tmp_path: Path, fault: str, nproc: int = 2) -> tuple:
    start = time.monotonic()
    probe = run_probe_in(
        tmp_path,
        "check_ep.py",
        "--backend-class",
        f"{BROKEN}:{fault}",
        *SMALL,
        *QUICK,
        "--nproc-per-node",
        str(nproc),
        timeout=240,
    )
    return probe, time.monotonic() - start


def step(report: dict, name: str) -> dict:
    return next(s for s in report["steps"] if s["name"] == name)


def test_a_memoized_dispatch_on_one_rank_is_a_stall_named_in_seconds(tmp_path: Path) -> None:
    probe, seconds = run(tmp_path, "ReplaysFromCacheOnRankOne")
    assert probe.proc.returncode == 3, probe.output
    replay = step(probe.report, "replay")
    assert replay["status"] == "error"
    detail = replay["detail"]
    assert (
        "rank 0 stopped making progress in replay (in the backend's dispatch, call #" in detail
    ), detail
    assert "after ranks [1] finished that step" in detail
    assert "wrong data" not in detail
    assert "stall" in replay["hint"] or "collective its peers never joined" in replay["hint"]
    failure = replay["data"]["failure"]
    assert failure["how"] == "stall" and failure["rank"] == 0
    assert failure["stall"]["bound"] >= 8.0
    # Well within the 300 s collective timeout: the bound is seconds, not minutes.
    assert seconds < 90, seconds


def test_wrong_rows_before_the_stall_make_it_a_failure(tmp_path: Path) -> None:
    probe, seconds = run(tmp_path, "ReplaysStaleRowsOnRankOne")
    assert probe.proc.returncode == 1, probe.output
    replay = step(probe.report, "replay")
    assert replay["status"] == "fail"
    assert "before it the backend returned wrong data: rank 1:" in replay["detail"]
    assert seconds < 90, seconds


def test_a_rank_hanging_after_its_last_collective_is_named_with_its_call(tmp_path: Path) -> None:
    probe, seconds = run(tmp_path, "HangsAfterCombineOnRankOne", nproc=4)
    assert probe.proc.returncode == 3, probe.output
    report = probe.report
    step_ = step(report, "dispatch_combine")
    wanted = "rank 1 stopped making progress in dispatch_combine (in the backend's combine, call #"
    assert wanted in step_["detail"], step_["detail"]
    assert "after ranks [0, 2, 3] finished that step" in step_["detail"]
    # The stalled rank's stack shows where it was (its supervisor asked for it).
    assert "sleep" in probe.output or "combine" in probe.output
    assert seconds < 90, seconds


def test_ranks_waiting_in_different_collectives_are_named_in_seconds(tmp_path: Path) -> None:
    """Rank 1 serves the bandwidth step's dispatches from its cache (wrong rows for the timed
    calls' new activations) without communicating and waits in the probe's barrier, while rank
    0 waits in the dispatch collective rank 1 never joined: a real desynchronised collective
    over gloo. Rank 0 is named, with its call and the rank that left it, within a minute (the
    default --timeout is 300 s), and the wrong rows keep the verdict at "failed" (exit 1)."""
    probe, seconds = run(tmp_path, "ServesTimedDispatchFromCacheOnRankOne")
    assert probe.proc.returncode == 1, probe.output
    band = step(probe.report, "bandwidth")
    assert band["status"] == "fail", band
    detail = band["detail"]
    wanted = "rank 0 stopped making progress in bandwidth (in the backend's dispatch, call #"
    assert wanted in detail, detail
    assert "ranks [1] returned from that call without it (a collective they never joined" in detail
    assert "before it the backend returned wrong data: rank 1: timed dispatch #0" in detail
    failure = band["data"]["failure"]
    assert failure["how"] == "stall" and failure["rank"] == 0, failure
    assert failure["stall"]["left"]["1"]["returned"] >= int(failure["call"].split("#")[1])
    assert probe.report["exit_code"] == 1
    assert seconds < 60, seconds


def calls(number: int | None, since: float, **extra: object) -> dict:
    return {"current": "bandwidth", "calls": {"number": number, "since": since, **extra}}


def test_a_rank_in_a_call_its_peer_left_stalls_only_past_the_bound() -> None:
    """The rule on its own: rank 0 in call #20 since t=100; rank 1 returned from call #21 at
    t=101. Not stalled at 108 (7 s after), stalled at 110 (the 8 s floor), never while no peer
    is past the call, and the bound grows with the peer's slowest call of the step."""
    state = calls(20, 100.0, call="dispatch, call #20")
    left = {1: {"returned": 21, "returned_at": 101.0, "slowest": 0.01, "step": "bandwidth"}}
    assert stall.stalled_in_call(state, left, 0, now=108.0) is None
    found = stall.stalled_in_call(state, left, 0, now=110.0)
    assert found is not None and found["call"] == "dispatch, call #20", found
    assert found["left"] == {"1": {"returned": 21, "call": None}}
    assert found["waited"] == 9.0 and found["bound"] == stall.STALL_FLOOR
    assert not found["wrong_data"]
    behind = {1: {**left[1], "returned": 19}}
    assert stall.stalled_in_call(state, behind, 0, now=500.0) is None
    slow = {1: {**left[1], "slowest": 4.0}}  # its calls take seconds: 5 times that
    assert stall.stalled_in_call(state, slow, 0, now=115.0) is None
    assert stall.stalled_in_call(state, slow, 0, now=122.0) is not None
    wrong = {1: {**left[1], "wrong": {"step": "bandwidth", "detail": "timed dispatch #0 ..."}}}
    found = stall.stalled_in_call(state, wrong, 0, now=110.0)
    assert (
        found is not None
        and found["wrong_data"]
        and found["wrong"] == {"1": "timed dispatch #0 ..."}
    )
