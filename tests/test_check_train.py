"""check_train on real process groups: the model trained over gloo on 1, 2 and 4 CPU processes.

Why these tests: check_train exists to catch what only training shows, so each class of fault
it names is injected here as a backend that passes check_ep's round trip (the torch reference
with one fault, tests/fixtures/broken_training.py) and must end with its own verdict and exit
code, every rank reaching the report; the reference and a correct backend that orders and sums
differently from the fallback must pass; and the command's usage, --all-backends and the report
are checked through the real command line.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FIXTURES, ROOT, clean_env, run_probe_in

from ep_image import child_env
from ep_image.probes.check_train.types import STEP_NAMES, agreement_bound, lr_for

BROKEN = FIXTURES / "broken_training.py"
FRONT_DOOR = str(ROOT / "probes" / "check_train.py")
#: A smaller model than the CPU default keeps the fault tests quick; 6 steps is the fewest the
#: memory verdict reads a leak from.
SMALL_SHAPE = ["--tokens", "128", "--seq", "64", "--hidden", "32", "--steps", "6"]
SMALL_SHAPE += ["--timeout", "120"]
# The faults' tests keep the rate they were written with (the default would be 0.02 here).
SMALL = [*SMALL_SHAPE, "--lr", "0.01"]


def run(tmp_path: Path, *args: str, nproc: int = 2, timeout: int = 300) -> tuple:
    extra = ["--nproc-per-node", str(nproc)] if nproc else []
    start = time.monotonic()
    probe = run_probe_in(tmp_path, "check_train.py", *args, *extra, timeout=timeout)
    return probe, time.monotonic() - start


def broken(name: str) -> list[str]:
    return ["--backend-class", f"{BROKEN}:{name}"]


def statuses(report: dict) -> dict[str, str]:
    return {s["name"]: s["status"] for s in report["steps"]}


def step(report: dict, name: str) -> dict:
    return next(s for s in report["steps"] if s["name"] == name)


# ---------------------------------------------------------------------------------------
# The reference trains, beside the fallback, at 2 and 4 ranks
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("ranks", [2, 4])
def test_reference_trains_beside_the_fallback(tmp_path: Path, ranks: int) -> None:
    probe, seconds = run(tmp_path, "--backend", "torch", nproc=ranks)
    report = probe.report
    assert probe.proc.returncode == 0, probe.output
    assert report["exit_code"] == 0 and report["result"] == "passed"
    assert list(statuses(report)) == list(STEP_NAMES)
    assert set(statuses(report).values()) <= {"pass", "info"}, statuses(report)
    n = report["numbers"]
    # The loss falls, in both trainings, by more than the tenth the verdict asks.
    for phase in ("fallback", "backend"):
        losses = n["losses"][phase]
        assert len(losses) == 8 and losses[-1] < 0.5 * losses[0], (phase, losses)
        assert n["median_step_seconds"][phase] > 0
    # The reference is the fallback's exchange by other means: every step bit for bit.
    assert n["losses"]["backend"] == n["losses"]["fallback"]
    assert n["speedup"] > 0 and n["backend_tokens_per_second"] > 0
    assert n["agreement_max_loss_rel_diff"] == 0.0 and n["agreement_max_grad_rel_diff"] == 0.0
    recompute = step(report, "recompute")["data"]
    # Every layer of every step was recomputed once, and got its forward's rows.
    assert len(recompute["recomputes"]) == 2 * 8
    assert all(c["how"] == "" for c in recompute["recomputes"])
    assert recompute["max_grad_rel"] == 0.0
    assert "checkpointing on (non-reentrant)" in probe.proc.stdout
    assert "CPU: not a GPU figure" in step(report, "speed")["detail"]
    assert report["training"]["agreement_bound"] == agreement_bound(2)
    assert report["training"]["lr"] == lr_for(64) == 1e-2  # the CPU model's hidden size
    assert report["world_size"] == ranks and report["dtype"] == "bfloat16"
    assert report["environment"]["prefix"] == sys.prefix
    assert "Traceback" not in probe.output
    # The budget: under a minute on 2 cores (a loaded machine gets some slack).
    assert seconds < 90, seconds


def test_the_default_learning_rate_shrinks_with_the_width(tmp_path: Path) -> None:
    """A fixed 1e-2 made the GPU model (hidden 1024) learn the task in one step and then
    diverge (loss 4.7 -> 0.006 -> 8.8 on an H200); the default is 0.64 / hidden, and --lr
    still wins."""
    assert lr_for(1024) == 6.25e-4 and lr_for(1024, 3e-3) == 3e-3
    probe, _ = run(tmp_path, "--backend", "torch", "--no-checkpoint", *SMALL_SHAPE, nproc=1)
    assert probe.proc.returncode == 0, probe.output
    assert probe.report["training"]["lr"] == lr_for(32) == 0.02  # the shape's hidden is 32
    assert "AdamW lr 0.02," in probe.proc.stdout
    (tmp_path / "given").mkdir()
    probe, _ = run(tmp_path / "given", "--backend", "torch", "--no-checkpoint", *SMALL_SHAPE,
                   "--lr", "0.005", nproc=1)  # fmt: skip
    assert probe.report["training"]["lr"] == 0.005


def test_without_checkpointing_the_recompute_is_not_run(tmp_path: Path) -> None:
    probe, _ = run(tmp_path, "--backend", "torch", "--no-checkpoint", *SMALL, nproc=1)
    assert probe.proc.returncode == 0, probe.output
    assert step(probe.report, "recompute")["status"] == "not run"
    assert "checkpointing off" in probe.proc.stdout
    assert probe.report["training"]["checkpoint"] is False


# ---------------------------------------------------------------------------------------
# What only training shows: each fault its own verdict
# ---------------------------------------------------------------------------------------


def test_a_recompute_with_fewer_rows_is_named(tmp_path: Path) -> None:
    probe, seconds = run(tmp_path, *broken("FewerRowsOnRecompute"), *SMALL, nproc=0)
    assert probe.proc.returncode == 1, probe.output
    recompute = step(probe.report, "recompute")
    assert recompute["status"] == "fail"
    assert "step 0, layer 1: the recompute's dispatch returned" in recompute["detail"]
    assert "(ranks [0])" in recompute["detail"]
    assert "rows where its forward got" in recompute["detail"]
    assert (
        "turn off activation checkpointing around this backend's MoE layers" in (recompute["hint"])
    )
    assert step(probe.report, "train")["status"] == "fail"
    assert "CheckpointError" not in probe.output and "Traceback" not in probe.output
    assert seconds < 90, seconds


def test_rows_permuted_on_recompute_under_the_first_handle_are_named(tmp_path: Path) -> None:
    probe, _ = run(tmp_path, *broken("PermutedRowsOnRecompute"), *SMALL, nproc=0)
    assert probe.proc.returncode == 1, probe.output
    detail = step(probe.report, "recompute")["detail"]
    assert "the rows of its forward in another order" in detail, detail


def test_a_backward_wrong_only_after_a_recompute_is_caught(tmp_path: Path) -> None:
    probe, _ = run(tmp_path, *broken("CombineBackwardWrongAfterRecompute"), *SMALL, nproc=0)
    assert probe.proc.returncode == 1, probe.output
    recompute = step(probe.report, "recompute")
    assert recompute["status"] == "fail"
    assert "differs from its own step without it" in recompute["detail"]
    assert "step 0: gradient differs by" in recompute["detail"]
    # Every recomputed dispatch got its forward's rows: the fault is in the backward.
    assert all(c["how"] == "" for c in recompute["data"]["recomputes"])
    agreement = step(probe.report, "agreement")
    assert agreement["status"] == "fail"
    assert agreement["data"]["max_grad_rel_diff"] > agreement_bound(2)


def test_memory_that_grows_every_step_is_named(tmp_path: Path) -> None:
    probe, _ = run(tmp_path, *broken("KeepsEveryStepsRows"), *SMALL, nproc=0)
    assert probe.proc.returncode == 1, probe.output
    memory = step(probe.report, "memory")
    assert memory["status"] == "fail"
    assert "grow every step" in memory["detail"] and "KiB a step" in memory["detail"]
    live = memory["data"]["live_bytes_per_step"]
    assert all(b > a for a, b in itertools.pairwise(live[1:])), live
    # Nothing else is wrong with it.
    others = {k: v for k, v in statuses(probe.report).items() if k != "memory"}
    assert set(others.values()) <= {"pass", "info"}, others


def test_nan_is_named_with_its_step_and_layer(tmp_path: Path) -> None:
    probe, _ = run(tmp_path, *broken("NaNFromThirdStep"), *SMALL, nproc=0)
    assert probe.proc.returncode == 1, probe.output
    train = step(probe.report, "train")
    assert train["status"] == "fail"
    assert "step 2, layer 0: the MoE output holds NaN or Inf" in train["detail"], train["detail"]


def test_a_slow_but_right_backend_is_a_warning_not_a_failure(tmp_path: Path) -> None:
    probe, _ = run(tmp_path, *broken("TenTimesSlower"), *SMALL, nproc=0)
    assert probe.proc.returncode == 0, probe.output
    speed = step(probe.report, "speed")
    assert speed["status"] == "info"
    assert "warning: the backend is" in speed["detail"]
    assert "slower than the fallback" in speed["detail"]
    assert speed["data"]["speedup"] < 0.5, speed["data"]


def test_a_backend_raising_on_one_rank_ends_in_seconds(tmp_path: Path) -> None:
    probe, seconds = run(tmp_path, *broken("RaisesAtThirdStepOnRankOne"), *SMALL)
    assert probe.proc.returncode == 3, probe.output
    report = probe.report
    assert report["result"] == "unusable"
    train = step(report, "train")
    assert train["status"] == "error"
    assert "simulated kernel fault at dispatch" in train["detail"]
    assert "rank 1" in train["detail"]
    assert all(
        statuses(report)[n] == "not run" for n in STEP_NAMES[STEP_NAMES.index("train") + 1 :]
    )
    assert seconds < 90, seconds


def test_rows_in_a_new_order_each_call_pass_only_along_the_forwards_layout(
    tmp_path: Path,
) -> None:
    """A correct backend whose rows come in a new order at every call (as a backend with
    atomic counters) and whose combine adds in another order: its recompute by dispatch gets
    its forward's rows in another order, which the backward cannot pair with the forward's
    handle (a failure with its fix); recomputed along the forward's layout it trains as the
    fallback does, within the bound."""
    probe, _ = run(tmp_path, *broken("ReordersRowsAndSums"), *SMALL, nproc=0)
    assert probe.proc.returncode == 1, probe.output
    detail = step(probe.report, "recompute")["detail"]
    assert "the rows of its forward in another order" in detail
    assert "--recompute cached" in step(probe.report, "recompute")["hint"]

    probe, _ = run(
        tmp_path, *broken("ReordersRowsAndSums"), *SMALL, "--recompute", "cached", nproc=0
    )
    assert probe.proc.returncode == 0, probe.output
    agreement = step(probe.report, "agreement")["data"]
    assert agreement["max_grad_rel_diff"] <= agreement["bound"]


# ---------------------------------------------------------------------------------------
# The command: usage, --all-backends, a python without torch
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--tokens", "100", "--seq", "64"], "--tokens 100 is not a multiple of --seq 64"),
        (["--steps", "1"], "--steps must be at least 2"),
        (["--all-backends", "--backend", "torch"], "--all-backends runs every backend"),
        (["--prefix", "/opt/venvs"], "--prefix is where --all-backends looks"),
        (["--lr", "0"], "--lr must be positive"),
        (["--hidden", "66", "--heads", "4"], "--hidden 66 is not divisible by --heads 4"),
    ],
)
def test_bad_usage_is_one_line_before_any_rank_starts(
    tmp_path: Path, args: list[str], says: str
) -> None:
    start = time.monotonic()
    probe, _ = run(tmp_path, "--backend", "torch", *args)
    assert probe.proc.returncode == 2, probe.output
    lines = probe.proc.stderr.strip().splitlines()
    assert lines == [lines[0]] and lines[0].startswith("check_train: usage error: "), lines
    assert says in lines[0]
    assert probe.report is None
    assert time.monotonic() - start < 30


def _venv_like(prefix: Path, name: str) -> None:
    """A venv under ``prefix/name`` whose packages are the test runner's (torch, no deep_ep)."""
    venv = prefix / name
    site = Path(sys.prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    (venv / "bin").mkdir(parents=True)
    (venv / site.relative_to(sys.prefix)).mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text((Path(sys.prefix) / "pyvenv.cfg").read_text())
    (venv / "bin" / "python").symlink_to(os.path.realpath(sys.executable))
    (venv / site.relative_to(sys.prefix) / "site-packages").symlink_to(site / "site-packages")


def test_all_backends_runs_each_venv_and_prints_one_table(tmp_path: Path) -> None:
    prefix = tmp_path / "venvs"
    for name in ("deepep_v2", "hybridep"):
        _venv_like(prefix, name)
    report = tmp_path / "out" / "train.json"
    flags = ["--all-backends", "--prefix", str(prefix), "--json", str(report)]
    proc = subprocess.run(
        [sys.executable, FRONT_DOOR, *flags],
        capture_output=True,
        text=True,
        timeout=300,
        env=child_env(clean_env()),
        cwd=tmp_path,
    )
    # Each venv holds torch and no deep_ep: each run says so, in its own venv's python.
    assert proc.returncode == 4, proc.stdout + proc.stderr
    table = proc.stdout[proc.stdout.index("check_train --all-backends") :]
    assert "deepep_v2    missing" in table and "hybridep     missing" in table
    assert "deepep_v2 requested but not installed" in table
    data = json.loads(report.read_text())
    assert [r["backend"] for r in data["rows"]] == ["deepep_v2", "hybridep"]
    assert [r["python"] for r in data["runs"]] == [
        str(prefix / n / "bin" / "python") for n in ("deepep_v2", "hybridep")
    ]
    assert data["exit_code"] == 4
    # Each run's own report beside the combined one.
    assert (report.parent / "train.deepep_v2.json").is_file()


def test_all_backends_without_venvs_names_the_prefix(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, FRONT_DOOR, "--all-backends", "--prefix", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(clean_env()),
        cwd=tmp_path,
    )
    assert proc.returncode == 4, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith(f"check_train: error: no backend venv under {tmp_path} (looked")
    assert lines[-1].startswith("check_train: fix: give --prefix (or EP_PREFIX)")


def test_te_on_without_te_is_missing(tmp_path: Path) -> None:
    probe, _ = run(tmp_path, "--backend", "torch", "--te", "on", *SMALL, nproc=1)
    assert probe.proc.returncode == 4, probe.output
    model = step(probe.report, "model")
    assert model["status"] == "missing"
    assert "--te on: Transformer Engine is not installed" in model["detail"]
