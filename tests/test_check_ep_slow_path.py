"""check_ep's bandwidth step against a backend that takes a slow path with the right numbers.

Why these tests: a backend that falls back to gathering every rank's tokens (an all-gather
after a missing capability) passed every step without a word. The bandwidth step now measures
each call's peak memory against its payload (on the CPU by following the storages the call's
torch operations create) and times the all-gather reference path on the same inputs; it warns,
without failing, when the backend is no faster or holds memory that grows with the world size.
The backends are in tests/fixtures/slow_backends.py, run on real gloo groups; a lean all_to_all
backend beside them must get no memory warning, and the reference itself is named as such.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import FIXTURES

SLOW = FIXTURES / "slow_backends.py"
SMALL = ["--tokens", "64", "--hidden", "64", "--experts", "16", "--topk", "4"]
QUICK = ["--iters", "3", "--warmup", "1", "--replays", "2", "--timeout", "120"]
# Top-2 of 16 experts on 4 ranks: a rank receives about 45 % of every rank's tokens, so a
# payload-sized buffer and a gather of every rank's tokens are told apart by their size.
SPARSE = ["--tokens", "64", "--hidden", "512", "--experts", "16", "--topk", "2"]
MEMORY_WARNING = "memory that grows with the world size"
SPEED_WARNING = "no faster than the all-gather reference path"


def slow(cls: str) -> list[str]:
    return ["--backend-class", f"{SLOW}:{cls}"]


def assert_only_warned(run: Any) -> dict[str, Any]:
    """Every step passed (a warning is no failure); the bandwidth step's merged data."""
    assert run.proc.returncode == 0, run.output
    assert set(run.statuses().values()) == {"pass"}, run.statuses()
    return run.step("bandwidth")


def test_the_reference_is_named_as_the_all_gather_path_not_warned_about(check_ep) -> None:
    run = check_ep("--backend", "torch", *SMALL, *QUICK, "--dtype", "bfloat16", nproc=2)
    band = assert_only_warned(run)
    assert "the torch reference is the all-gather path itself: not compared" in band["detail"]
    assert "warning" not in band["detail"]
    slow_path = band["data"]["slow_path"]
    assert slow_path["reference_itself"] is True and slow_path["warnings"] == []
    assert "dispatch_speedup_vs_reference" not in slow_path  # nothing else was timed
    # Its memory is measured all the same, from the storages its torch operations create.
    assert slow_path["memory_measured_by"].startswith("the storages of the tensors")
    for rank in band["data"]["ranks"]:
        # Dispatch gathers every rank's tokens, then returns its own rows: beyond them, it held
        # at least the gather (the warning's threshold, which the reference itself meets).
        assert rank["dispatch_beyond_output_bytes"] >= rank["gather_bytes"], rank
        assert rank["dispatch_returned_bytes"] >= rank["payload_bytes"] > 0, rank
        assert rank["reference"] is None
    assert run.report["numbers"]["slow_path_warnings"] == []


def test_a_backend_that_gathers_twice_and_waits_is_warned_about(check_ep) -> None:
    run = check_ep(*slow("GathersTwiceAndSleeps"), *SMALL, *QUICK, "--dtype", "bfloat16", nproc=2)
    band = assert_only_warned(run)
    detail = band["detail"]
    assert f"warning: dispatch {SPEED_WARNING}" in detail, detail
    assert f"warning: combine {SPEED_WARNING}" in detail, detail
    assert f"{MEMORY_WARNING}" in detail and "warning: dispatch held " in detail, detail
    assert detail.endswith("(an all-gather fallback after a missing capability?)"), detail
    assert band["hint"].startswith("the numbers are right but the backend is no faster")
    slow_path = band["data"]["slow_path"]
    assert slow_path["reference_itself"] is False
    assert slow_path["dispatch_speedup_vs_reference"] < 1
    assert slow_path["combine_speedup_vs_reference"] < 1
    for rank in band["data"]["ranks"]:
        # The reference path was timed and measured on every rank, the same way.
        assert rank["reference"]["timed_calls"] == 3
        assert rank["reference"]["dispatch_seconds"] > 0
        assert rank["reference"]["dispatch_peak_bytes"] > 0
    numbers = run.report["numbers"]
    assert numbers["slow_path_warnings"] == slow_path["warnings"]
    assert numbers["slow_path_dispatch_speedup_vs_reference"] < 1


@pytest.mark.parametrize("cls", ["HoldsWorldSizedBuffers", "SendsRoutedRowsOnly"])
def test_world_sized_buffers_are_warned_about_and_a_payload_sized_exchange_is_not(
    check_ep, cls: str
) -> None:
    run = check_ep(*slow(cls), *SPARSE, *QUICK, "--dtype", "bfloat16", nproc=4)
    band = assert_only_warned(run)
    detail = band["detail"]
    ranks = band["data"]["ranks"]
    assert all(r["payload_bytes"] < 0.6 * r["gather_bytes"] for r in ranks), ranks
    if cls == "HoldsWorldSizedBuffers":
        for op in ("dispatch", "combine"):
            assert f"warning: {op} held " in detail, detail
        assert detail.count(MEMORY_WARNING) == 2, detail
        assert band["data"]["slow_path"]["dispatch_peak_vs_payload"] > 2
    else:
        assert MEMORY_WARNING not in detail, detail
        for r in ranks:
            for op in ("dispatch", "combine"):
                assert 0 < r[f"{op}_beyond_output_bytes"] < r["gather_bytes"], (op, r)


def test_at_one_rank_the_figures_carry_its_label_and_no_speed_warning(check_ep) -> None:
    """One rank crosses no link, and the reference path there gathers nothing: the figures are
    reported under the one-rank label, and no speed warning is drawn from them."""
    run = check_ep(*slow("GathersTwiceAndSleeps"), *SMALL, *QUICK, "--dtype", "bfloat16")
    band = assert_only_warned(run)
    detail = band["detail"]
    assert detail.startswith("one rank: no link crossed, not a link figure: "), detail
    assert "(speed warning not applied: one rank crosses no link)" in detail, detail
    assert "warning:" not in detail, detail
    assert band["data"]["slow_path"]["dispatch_speedup_vs_reference"] < 1


# ---------------------------------------------------------------------------------------
# The measurement and the rules, in-process
# ---------------------------------------------------------------------------------------


def test_the_cpu_measure_follows_what_a_call_allocates_and_frees() -> None:
    from ep_image.probes.check_ep.checks.call_memory import CPU_HOW, measure

    kept = torch.zeros(1 << 16, dtype=torch.uint8)  # allocated before: not the call's

    def call() -> torch.Tensor:
        scratch = torch.zeros(1 << 20, dtype=torch.uint8)  # 1 MiB, freed before the end
        view = kept[:100]  # a view: no new storage
        kept.add_(1)  # in place: no new storage
        del scratch
        small = torch.ones(1 << 18, dtype=torch.uint8)  # 256 KiB, freed
        del small, view
        return torch.ones(1000, dtype=torch.float32)  # 4000 bytes, returned

    out, memory = measure(call, torch.device("cpu"))
    assert out.shape == (1000,)
    assert memory.how == CPU_HOW
    assert memory.peak == 1 << 20  # the scratch alone; the rest came after it was freed
    assert memory.returned == 4000
    assert memory.beyond_output == (1 << 20) - 4000


def _rank(
    payload: int, gather: int, beyond: int, seconds: float, reference: float | None
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "payload_bytes": payload,
        "gather_bytes": gather,
        "memory_measured_by": "test",
        "reference": None,
    }
    for op in ("dispatch", "combine"):
        out |= {
            f"{op}_seconds": seconds,
            f"{op}_peak_bytes": beyond + payload,
            f"{op}_returned_bytes": payload,
            f"{op}_beyond_output_bytes": beyond,
        }
    if reference is not None:
        out["reference"] = {"dispatch_seconds": reference, "combine_seconds": reference}
    return out


@pytest.mark.parametrize(
    ("payload", "beyond", "seconds", "shared", "warned"),
    [
        (60, 100, 1.0, False, ["held", "held", "no faster", "no faster"]),  # a slow fallback
        (60, 99, 0.5, False, []),  # faster, scratch under the gather
        (100, 500, 0.5, False, []),  # every rank's tokens arrive: a gather is no extra
        (60, 100, 1.0, True, ["held", "held"]),  # shared GPU: memory only
    ],
)
def test_the_warnings_follow_the_rules(
    payload: int, beyond: int, seconds: float, shared: bool, warned: list[str]
) -> None:
    from ep_image.probes.check_ep.checks.slow_path import detail, summarize

    datas = [_rank(payload, 100, beyond, seconds, reference=1.0) for _ in range(2)]
    summary = summarize(datas, shared)
    kinds = ["held" if " held " in w else "no faster" for w in summary["warnings"]]
    assert kinds == warned, summary["warnings"]
    assert summary["dispatch_speedup_vs_reference"] == pytest.approx(1.0 / seconds)
    if shared:
        assert "(speed warning not applied: ranks share a GPU)" in detail(summary)
    reference = summarize([_rank(payload, 100, beyond, seconds, None) for _ in range(2)], shared)
    assert reference["warnings"] == [] and reference["reference_itself"] is True
