"""check_ep names a rank that stopped making progress in a step its peers finished, in seconds.

Why these tests: a backend that skips a collective on one rank (a memoized result) or hangs
there after its last collective leaves its peers waiting; before, only the collective timeout
ended such a run (300 s by default, 314-320 s to "unusable"). Each case here runs with the
default --timeout and must end well within it, naming the rank, the step and the backend call,
with exit 1 when the backend returned wrong data before the stall and 3 when it did not.
"""

from __future__ import annotations

import time
from pathlib import Path

from conftest import BROKEN, run_probe_in

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
