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
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, ROOT, clean_env, run_probe_in

from ep_image import backends, child_env
from ep_image.probes._ranks.runtime import ONE_RANK_LABEL
from ep_image.probes.check_train import all_backends, cli, loop, verdicts
from ep_image.probes.check_train.recompute import HASHES, Fingerprint, finding_of
from ep_image.probes.check_train.steps import STEP_NAMES
from ep_image.probes.check_train.types import (
    SPEED_PAIRS,
    SPEED_WARMUP_PAIRS,
    agreement_bound,
    lr_for,
)

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
    # Every layer of every step was recomputed once, and got its forward's rows in its order.
    assert len(recompute["recomputes"]) == 2 * 8
    assert all(c["found"] == "same" for c in recompute["recomputes"])
    assert recompute["findings"]["same"] == 16 and sum(recompute["findings"].values()) == 16
    assert recompute["frameworks"] == {
        "dispatch_with_its_handle": "yes",
        "dispatch_with_forward_handle": "yes",
        "cached_dispatch": "not run",
    }
    assert n["recompute_frameworks"] == recompute["frameworks"]
    assert recompute["max_grad_rel"] == 0.0
    assert (
        "checkpointing on (non-reentrant), recompute by dispatch, its handle used by the "
        "backward" in probe.proc.stdout
    )
    assert report["training"]["backward_handle"] == "recompute's"
    speed = step(report, "speed")
    assert "CPU: not a GPU figure" in speed["detail"]
    # Both exchanges timed alike: the same warm-up, as many timed steps, taken in turn. The
    # reference is the fallback's exchange by other means: a sane ratio even on a loaded CPU.
    protocol = speed["data"]["protocol"]
    assert protocol["warmup_pairs"] == 2 and protocol["pairs"] == 6
    assert len(protocol["backend_seconds"]) == len(protocol["fallback_seconds"]) == 6
    assert protocol["first"] == ["backend", "fallback"] * 3
    assert 0.2 < n["speedup"] < 5, speed["detail"]
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
    """A recompute that returns its forward's rows in another order under the forward's
    handle: the backward takes the recompute's rows back along a handle that does not follow
    them (two layouts mixed), and the gradients say so."""
    probe, _ = run(tmp_path, *broken("PermutedRowsOnRecompute"), *SMALL, nproc=0)
    assert probe.proc.returncode == 1, probe.output
    recompute = step(probe.report, "recompute")
    detail = recompute["detail"]
    assert recompute["status"] == "fail"
    assert "returned their forwards' rows (12 of 12 in another order)" in detail, detail
    assert "the backward mixes two layouts" in detail and "step 0: gradient differs" in detail
    assert "handle must take the rows its dispatch returned back" in recompute["hint"]
    assert recompute["data"]["findings"]["reordered"] == 12
    assert recompute["data"]["frameworks"]["dispatch_with_its_handle"] == "no"
    assert step(probe.report, "agreement")["status"] == "fail"


def test_a_backward_wrong_only_after_a_recompute_is_caught(tmp_path: Path) -> None:
    probe, _ = run(tmp_path, *broken("CombineBackwardWrongAfterRecompute"), *SMALL, nproc=0)
    assert probe.proc.returncode == 1, probe.output
    recompute = step(probe.report, "recompute")
    assert recompute["status"] == "fail"
    assert "differs from its own step without it" in recompute["detail"]
    assert "step 0: gradient differs by" in recompute["detail"]
    # Every recomputed dispatch got its forward's rows: the fault is in the backward.
    assert all(c["found"] == "same" for c in recompute["data"]["recomputes"])
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


def test_rows_in_a_new_order_each_call_pass(tmp_path: Path) -> None:
    """A correct backend whose rows come in a new order at every call (as DeepEP v2's do) with
    a handle that follows them, and whose combine adds in another order: its recompute by
    dispatch gets its forward's rows in another order, which the backward along the
    recompute's handle takes right; the report says so, and which recompute a framework can
    use with it. Recomputed along the forward's layout, it trains as well."""
    probe, _ = run(tmp_path, *broken("ReordersRowsAndSums"), *SMALL, nproc=0)
    assert probe.proc.returncode == 0, probe.output
    recompute = step(probe.report, "recompute")
    assert recompute["status"] == "pass", recompute["detail"]
    assert "reordered (12 of 12 in another order)" in recompute["detail"]
    assert recompute["data"]["findings"]["reordered"] == 12
    assert {c["how"] for c in recompute["data"]["recomputes"]} == {
        "the rows of its forward in another order"
    }
    assert recompute["data"]["frameworks"] == {
        "dispatch_with_its_handle": "yes",
        "dispatch_with_forward_handle": "no",
        "cached_dispatch": "not run",
    }
    assert "reentrant, as Megatron's" in recompute["data"]["verdict"]
    assert recompute["data"]["max_grad_rel"] <= recompute["data"]["bound"]
    agreement = step(probe.report, "agreement")["data"]
    assert agreement["max_grad_rel_diff"] <= agreement["bound"]

    probe, _ = run(
        tmp_path, *broken("ReordersRowsAndSums"), *SMALL, "--recompute", "cached", nproc=0
    )
    assert probe.proc.returncode == 0, probe.output
    agreement = step(probe.report, "agreement")["data"]
    assert agreement["max_grad_rel_diff"] <= agreement["bound"]
    recompute = step(probe.report, "recompute")["data"]
    assert recompute["frameworks"]["cached_dispatch"] == "yes"
    assert recompute["frameworks"]["dispatch_with_its_handle"] == "not run"
    assert "recompute by cached dispatch (forward's handle)" in probe.proc.stdout


def test_top_k_slots_in_a_new_order_each_call_pass(tmp_path: Path) -> None:
    """A correct backend that returns each row's top-k slots in a new order at every call,
    its handle carrying the weights' gradients back to the token's own slots: the recompute
    finds the same rows with their slots in another order, and the training is right."""
    probe, _ = run(tmp_path, *broken("PermutesSlotsEveryCall"), *SMALL, nproc=0)
    assert probe.proc.returncode == 0, probe.output
    recompute = step(probe.report, "recompute")
    assert recompute["data"]["findings"]["slots"] == 12, recompute["data"]["findings"]
    assert "12 of 12 with top-k slots inside rows in another order" in recompute["detail"]
    assert recompute["data"]["frameworks"]["dispatch_with_its_handle"] == "yes"
    assert recompute["data"]["frameworks"]["dispatch_with_forward_handle"] == "no"


@pytest.mark.parametrize(
    ("fault", "says", "found"),
    [
        ("OtherTokenRowsOnRecompute", "other token rows", "token_rows"),
        ("OtherCountsOnRecompute", "other counts per expert than its forward", "counts"),
        ("OtherWeightsOnRecompute", "the same rows and experts with other weights (bits)",
         "weights"),
    ],
)  # fmt: skip
def test_a_recompute_with_other_rows_counts_or_weights_is_named(
    tmp_path: Path, fault: str, says: str, found: str
) -> None:
    """Not the forward's rows in any order: the training stops at once on every rank with
    what differed, whether or not the gradients would have shown it."""
    probe, _ = run(tmp_path, *broken(fault), *SMALL, nproc=0)
    assert probe.proc.returncode == 1, probe.output
    recompute = step(probe.report, "recompute")
    assert recompute["status"] == "fail"
    assert recompute["detail"] == (
        f"step 0, layer 1: the recompute's dispatch returned {says} (ranks [0])"
    )
    assert recompute["data"]["recomputes"][-1]["found"] == found
    assert recompute["data"]["frameworks"]["dispatch_with_its_handle"] == "no"
    assert "turn off activation checkpointing" in recompute["hint"]
    assert step(probe.report, "train")["status"] == "fail"
    assert "Traceback" not in probe.output


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
        (["--lr", "0"], "--lr must be a positive finite number, got 0"),
        # Inputs that cannot train were blamed on the backend: exit 1 "where the fallback does
        # not" (inf, 1e10: the fallback diverged too), exit 3 from AdamW's RuntimeError (1e300),
        # "the backend's gradients are wrong" (--tokens 1).
        (["--lr", "inf"], "--lr must be a positive finite number, got inf"),
        (["--lr", "nan"], "--lr must be a positive finite number, got nan"),
        (["--lr", "1e10"], "--lr 1e+10 is above 1: Adam moves every weight"),
        (["--lr", "1e300"], "--lr 1e+300 is above 1"),
        (["--tokens", "1"], "--tokens 1 is too few to train on: the run must show the model"),
        (
            ["--tokens", "2", "--experts", "16"],
            "--tokens 2 is too few to train on: each step's 2 x --tokens x top-2 slots must "
            "reach every one of the 16 experts (else some never get a token to train on), so "
            "at least 4 per rank here",
        ),
        # 0 ranks meant one, silently.
        (["--nproc-per-node", "0"], "--nproc-per-node must be >= 1, got 0"),
        (["--hidden", "66", "--heads", "4"], "--hidden 66 is not divisible by --heads 4"),
    ],
)
def test_bad_usage_is_one_line_before_any_rank_starts(
    tmp_path: Path, args: list[str], says: str
) -> None:
    start = time.monotonic()
    nproc = 0 if "--nproc-per-node" in args else 2
    probe, _ = run(tmp_path, "--backend", "torch", *args, nproc=nproc)
    assert probe.proc.returncode == 2, probe.output
    lines = probe.proc.stderr.strip().splitlines()
    assert lines == [lines[0]] and lines[0].startswith("check_train: usage error: "), lines
    assert says in lines[0]
    assert probe.report is None
    assert time.monotonic() - start < 30


def test_settings_the_fallback_cannot_train_with_are_not_the_backends_fault(
    tmp_path: Path,
) -> None:
    """A rate at the bound diverges with any exchange (the CPU model's loss 4.9 -> 34): the
    fallback says the model did not train with these settings and the backend is not judged
    (before: "the backend's gradients are wrong", exit 1, beside the fallback's own fail)."""
    probe, _ = run(tmp_path, "--backend", "torch", *SMALL_SHAPE, "--lr", "1", nproc=1)
    assert probe.proc.returncode == 1, probe.output
    fallback = step(probe.report, "fallback")
    assert fallback["status"] == "fail"
    assert fallback["detail"].startswith(verdicts.DID_NOT_TRAIN), fallback["detail"]
    assert "the backend is not judged" in fallback["detail"]
    assert fallback["hint"].startswith("not the backend's doing")
    after = STEP_NAMES[STEP_NAMES.index("fallback") + 1 :]
    assert {n: statuses(probe.report)[n] for n in after} == dict.fromkeys(after, "not run")
    assert step(probe.report, "train")["detail"] == verdicts.NOT_JUDGED
    assert "gradients are wrong" not in probe.output
    assert "where the fallback does not" not in probe.output


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
    # No GPU here: every backend runs as the flags say (one rank), and its row says so.
    assert data["gpus"] == 0
    assert [r["argv"] for r in data["runs"]] == [[], []]
    assert [(r["ranks"], r["ranks_per_gpu"]) for r in data["rows"]] == [(1, 1), (1, 1)]
    assert "backend      result     ranks" in table
    assert "deepep_v2    missing    1 " in table


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


#: Fake venvs' pythons, by what they do: each a shell script that ignores its arguments.
_FAKE_PYTHONS = {
    # Hangs with a child of its own (not exec: the group, not just the script, must go).
    "hangs": 'echo $$ > "{pids}/{name}.sh"; sleep 1000 & echo $! > "{pids}/{name}.sleep"; wait',
    "segfaults": "ulimit -c 0; kill -SEGV $$",
    "exits 7": "exit 7",
}


def _fake_venvs(tmp_path: Path, behaviour: dict[str, str]) -> tuple[Path, Path]:
    """A prefix whose backend venvs' bin/python do what ``behaviour`` says; where the hanging
    ones write their pids."""
    prefix, pids = tmp_path / "venvs", tmp_path / "pids"
    pids.mkdir()
    for name, what in behaviour.items():
        python = prefix / name / "bin" / "python"
        python.parent.mkdir(parents=True)
        python.write_text("#!/bin/sh\n" + _FAKE_PYTHONS[what].format(pids=pids, name=name) + "\n")
        python.chmod(0o755)
    return prefix, pids


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped yet does not)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rfind(")") + 2 :][:1] not in ("Z", "X")


def _launcher_env(tmp_path: Path) -> dict[str, str]:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    return child_env(clean_env(TMPDIR=str(tmpdir)))


def test_all_backends_bounds_each_run_and_names_how_it_ended(tmp_path: Path) -> None:
    """A venv whose python hangs was waited on forever (with --timeout 10, 90 s and
    counting); one that crashed read "no report". Each run now has a deadline (--timeout for
    each of its steps and its start: 0.25 s x 12 here), is stopped with what it started, and
    its row says how it ended; the temporary directory goes too."""
    prefix, pids = _fake_venvs(
        tmp_path, {"deepep_v1": "hangs", "deepep_v2": "segfaults", "hybridep": "exits 7"}
    )
    env = _launcher_env(tmp_path)
    report = tmp_path / "out" / "train.json"
    flags = ["--all-backends", "--prefix", str(prefix), "--device", "cpu", "--timeout", "0.25"]
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, FRONT_DOOR, *flags, "--json", str(report)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    took = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out
    assert took < 60, f"{took:.0f} s"
    table = proc.stdout[proc.stdout.index("check_train --all-backends") :]
    deadline = "the deadline, 3 s: --timeout 0.25 s x 12"
    assert re.search(rf"deepep_v1 +timed out .*\n +timed out after 3 s \({deadline}\)", table)
    assert re.search(r"deepep_v2 +crashed .*\n +killed by SIGSEGV without a report", table)
    assert re.search(r"hybridep +no report .*\n +exited 7 without a report", table)
    data = json.loads(report.read_text())
    assert data["deadline_seconds"] == 3
    assert [(r["exit_code"], r["returncode"]) for r in data["runs"]][1:] == [(3, -11), (3, 7)]
    assert data["runs"][0]["exit_code"] == 3 and data["runs"][0]["seconds"] < 30
    for name in ("sh", "sleep"):
        pid = int((pids / f"deepep_v1.{name}").read_text())
        assert not _alive(pid), f"the hanging run's {name} (pid {pid}) outlived its deadline"
    assert list(Path(env["TMPDIR"]).iterdir()) == []


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM", "SIGINT"])
def test_nothing_outlives_the_all_backends_launcher(tmp_path: Path, how: str) -> None:
    """The launcher stopped (SIGTERM, Ctrl-C) or killed (SIGKILL) while a venv's python
    hangs: that python, what it started and the launcher's temporary directory go with it
    (before: all three stayed)."""
    prefix, pids = _fake_venvs(tmp_path, {"deepep_v1": "hangs"})
    env = _launcher_env(tmp_path)
    log = (tmp_path / "launcher.log").open("w")
    launcher = subprocess.Popen(
        [sys.executable, FRONT_DOOR, "--all-backends", "--prefix", str(prefix), "--device", "cpu"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 60
        while not (pids / "deepep_v1.sleep").exists():
            assert launcher.poll() is None, (tmp_path / "launcher.log").read_text()
            assert time.monotonic() < deadline, "the hanging venv never started"
            time.sleep(0.05)
        assert list(Path(env["TMPDIR"]).glob("check_train-all-*"))
        sh, sleep = (int((pids / f"deepep_v1.{n}").read_text()) for n in ("sh", "sleep"))
        launcher.send_signal(getattr(signal, how))
        code = launcher.wait(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        log.close()
    said = (tmp_path / "launcher.log").read_text()
    assert code == {"SIGKILL": -9, "SIGTERM": 143, "SIGINT": 130}[how], said
    deadline = time.monotonic() + 10
    while (_alive(sh) or _alive(sleep)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(sh) and not _alive(sleep), f"the venv's python outlived the launcher: {said}"
    while list(Path(env["TMPDIR"]).iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(Path(env["TMPDIR"]).iterdir()) == [], "the launcher's temporary directory stayed"


def test_te_on_without_te_is_missing(tmp_path: Path) -> None:
    probe, _ = run(tmp_path, "--backend", "torch", "--te", "on", *SMALL, nproc=1)
    assert probe.proc.returncode == 4, probe.output
    model = step(probe.report, "model")
    assert model["status"] == "missing"
    assert "--te on: Transformer Engine is not installed" in model["detail"]


# ---------------------------------------------------------------------------------------
# In-process: the fingerprint's findings, the speed's protocol, --help, the ranks per backend
# ---------------------------------------------------------------------------------------


def _dispatched(dtype: torch.dtype, rows: int = 6, hidden: int = 300, k: int = 3) -> tuple:
    """A dispatch's rows (``hidden`` wider than two hashed chunks), local experts (-1: another
    rank's) and weights, with each row's experts distinct."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn((rows, hidden), generator=gen).to(dtype)
    idx = torch.stack([torch.randperm(8, generator=gen)[:k] - 2 for _ in range(rows)])
    idx = idx.clamp(min=-1)
    w = torch.rand((rows, k), generator=gen)
    return x, idx, w


def _counts(idx: torch.Tensor) -> list[int]:
    return torch.bincount(idx[idx >= 0], minlength=6).tolist()


def _finding(was: tuple, found: tuple) -> tuple[str, bool]:
    """What a recompute that got ``found`` finds against a forward that got ``was``."""
    a = Fingerprint.of(*was, _counts(was[1]))
    b = Fingerprint.of(*found, _counts(found[1]))
    if b.shape_finding(a) != "same":
        return b.shape_finding(a), False
    equal = (a.hashes == b.hashes).tolist()
    return finding_of(dict(zip(HASHES, equal, strict=True)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64])
def test_the_fingerprint_names_what_changed(dtype: torch.dtype) -> None:
    """Each way a recompute's rows can differ from its forward's reads as exactly one finding;
    the same rows in another order, or with their slots in another order, stay the same
    rows."""
    x, idx, w = _dispatched(dtype)
    same = (x, idx, w)
    assert _finding(same, (x.clone(), idx.clone(), w.clone())) == ("same", False)
    order = torch.tensor([3, 0, 5, 1, 4, 2])
    assert _finding(same, (x[order], idx[order], w[order])) == ("reordered", True)
    slots = torch.tensor([2, 0, 1])
    assert _finding(same, (x, idx[:, slots], w[:, slots])) == ("slots", False)
    assert _finding(same, (x[order], idx[order][:, slots], w[order][:, slots])) == (
        "slots",
        True,
    )
    local = (idx[1] >= 0).nonzero()[0, 0]
    w2 = w.clone()
    w2[1, local] = torch.nextafter(w2[1, local], torch.tensor(2.0))
    assert _finding(same, (x, idx, w2)) == ("weights", False)
    # The weight of another rank's expert (-1) is none of this rank's: a backend may leave it.
    assert (idx == -1).any()
    w5 = torch.where(idx >= 0, w, torch.full_like(w, float("nan")))
    assert _finding(same, (x, idx, w5)) == ("same", False)
    # Two rows swap one expert each: the counts per expert stay, the routing does not.
    idx2 = idx.clone()
    idx2[0, 0], idx2[1, 0] = 5, 4
    idx3 = idx.clone()
    idx3[0, 0], idx3[1, 0] = 4, 5
    assert _counts(idx2) == _counts(idx3)
    assert _finding((x, idx2, w), (x, idx3, w)) == ("experts", False)
    x2 = x.clone()
    x2[2, 299] = x2[2, 299] + 1  # in the last, partial chunk of columns
    assert _finding(same, (x2, idx, w)) == ("token_rows", False)
    # Two rows exchange one element: every column's sum stays, the rows do not.
    x3 = x.clone()
    x3[0, 0], x3[1, 0] = x[1, 0], x[0, 0]
    if not torch.equal(x3, x):
        assert _finding(same, (x3, idx, w)) == ("token_rows", False)
    idx4 = idx.clone()
    idx4[idx4 >= 0] = (idx4[idx4 >= 0] + 1) % 6
    assert _finding(same, (x, idx4, w))[0] in ("counts", "experts")
    assert _finding(same, (x[1:], idx[1:], w[1:])) == ("rows", False)


def test_the_fingerprint_of_no_rows() -> None:
    """A rank that received no row hashes to the same empty fingerprint, in any dtype."""
    for dtype in (torch.bfloat16, torch.float32, torch.int64):
        x = torch.zeros((0, 64), dtype=dtype)
        idx = torch.zeros((0, 2), dtype=torch.int64)
        w = torch.zeros((0, 2))
        a, b = Fingerprint.of(x, idx, w, [0, 0]), Fingerprint.of(x.clone(), idx, w, [0, 0])
        assert a.rows == 0 and a.hashes.dtype == torch.int64
        assert torch.equal(a.hashes, b.hashes)
        assert a.hashes.shape == (len(HASHES),)


def test_the_fingerprint_keeps_no_copy_and_stays_on_the_device() -> None:
    """The forward's fingerprint is a few int64 on the rows' device (no host sync, no copy of
    the rows that checkpointing exists to drop)."""
    x, idx, w = _dispatched(torch.bfloat16, rows=64)
    f = Fingerprint.of(x, idx, w, _counts(idx))
    tensors = [v for v in vars(f).values() if isinstance(v, torch.Tensor)]
    assert tensors == [f.hashes] and f.hashes.numel() == len(HASHES)
    assert f.hashes.device == x.device


class _Clock:
    """A trainer whose every step takes a fixed time per exchange, on a fake clock."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, costs: dict[str, float]) -> None:
        self.now = 0.0
        self.costs = costs
        self.calls: list[tuple[int, str, bool]] = []
        monkeypatch.setattr(loop.time, "perf_counter", lambda: self.now)
        self.phase = loop.Phase(
            shape=None, seed=0, rank=0, world=1, device=torch.device("cpu"),
            dtype=torch.bfloat16, group=None, lr=0.01, steps=8,
        )  # fmt: skip
        self.optimizer = types.SimpleNamespace(step=lambda: None)

    def forward_backward(self, step: int, exchange: object, checkpointed: bool) -> float:
        name = getattr(exchange, "name", "")
        self.calls.append((step, name, checkpointed))
        self.now += self.costs[name]
        return 0.0


class _Exchange:
    def __init__(self, name: str) -> None:
        self.name = name
        self.begun: list[tuple[int, bool]] = []

    def begin(self, step: int, checking: bool) -> None:
        self.begun.append((step, checking))


def test_the_speed_is_timed_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both exchanges take whole steps in turn on the same batches after the same warm-up,
    the first swapped every pair, the recompute unchecked: an exchange as fast as the
    fallback reads 1.0x, and a backend twice as fast 2.0x, whatever ran before it."""
    trainer = _Clock(monkeypatch, {"backend": 0.5, "fallback": 0.5})
    backend, fallback = _Exchange("backend"), _Exchange("fallback")
    timing = loop.time_alike(trainer, backend, fallback, True)
    pairs = SPEED_WARMUP_PAIRS + SPEED_PAIRS
    assert [c[0] for c in trainer.calls] == [8 + i // 2 for i in range(2 * pairs)]
    assert [c[1] for c in trainer.calls] == ["backend", "fallback", "fallback", "backend"] * (
        pairs // 2
    )
    assert all(c[2] for c in trainer.calls)
    assert backend.begun == [(8 + i, False) for i in range(pairs)]
    assert timing["first"] == ["backend", "fallback"] * (SPEED_PAIRS // 2)
    assert timing["backend_seconds"] == timing["fallback_seconds"] == [0.5] * SPEED_PAIRS
    result = loop.PhaseResult(timing=timing)
    speed = verdicts.step_speed(result, loop.PhaseResult(), 1000, "", True)
    assert speed.data["speedup"] == 1.0 and "1.00x over 6 pairs" in speed.detail

    trainer = _Clock(monkeypatch, {"backend": 0.25, "fallback": 0.5})
    timing = loop.time_alike(trainer, _Exchange("backend"), _Exchange("fallback"), False)
    speed = verdicts.step_speed(loop.PhaseResult(timing=timing), loop.PhaseResult(), 1000, "",
                                False)  # fmt: skip
    assert speed.data["speedup"] == 2.0
    assert speed.data["backend_step_seconds"] == 0.25


def test_one_rank_on_a_gpu_expects_no_speedup_and_warns_of_no_slow_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On one GPU rank the fallback's all-gather moves nothing (on an H100 DeepEP v2 read 0.93x
    and NCCL EP 0.89x there): slower is no sign of a slow path; at 2 ranks it is."""
    trainer = _Clock(monkeypatch, {"backend": 0.55, "fallback": 0.5})
    timing = loop.time_alike(trainer, _Exchange("backend"), _Exchange("fallback"), False)
    result = loop.PhaseResult(timing=timing)
    one = verdicts.step_speed(result, loop.PhaseResult(), 1000, ONE_RANK_LABEL, False)
    assert "no speedup to expect" in one.detail and "warning" not in one.detail, one.detail
    assert not one.hint
    two = verdicts.step_speed(result, loop.PhaseResult(), 1000, "", False)
    assert "warning: the backend is 1.1x slower than the fallback" in two.detail, two.detail


def test_help_names_only_flags_it_takes() -> None:
    """Every flag --help names is one check_train takes (check_ep's --min-gbs was named in
    --ranks-per-gpu's help, which check_train shares)."""
    parser = cli.build_parser()
    text = parser.format_help()
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*[a-z]", text)) - {"--help"}
    assert "--ranks-per-gpu" in flags and "--recompute" in flags
    for flag in sorted(flags):
        action = parser._option_string_actions.get(flag)
        assert action is not None, f"--help names {flag}, which check_train does not take"
        value = [] if action.nargs == 0 else [str((action.choices or ["2"])[0])]
        _, unknown = parser.parse_known_args([flag, *value])
        assert unknown == [], (flag, unknown)


def test_all_backends_starts_each_backend_at_the_ranks_it_needs() -> None:
    """On one GPU, DeepEP v1 and HybridEP (never run at one rank) start 2 ranks sharing it,
    the others one; on more GPUs each takes the most ranks it runs at, one a GPU; without a
    GPU, or with ranks given on the command line, the flags decide."""
    ranks = {g: {n: all_backends.ranks_for(n, g) for n in backends.BACKEND_NAMES} for g in
             (0, 1, 2, 3, 8)}  # fmt: skip
    assert ranks[1] == {"deepep_v1": (2, 2), "deepep_v2": (1, 1), "hybridep": (2, 2),
                        "ncclep": (1, 1)}  # fmt: skip
    assert ranks[2] == dict.fromkeys(backends.BACKEND_NAMES, (2, 1))
    assert ranks[3] == {"deepep_v1": (2, 1), "deepep_v2": (3, 1), "hybridep": (3, 1),
                        "ncclep": (3, 1)}  # fmt: skip
    assert ranks[8] == dict.fromkeys(backends.BACKEND_NAMES, (8, 1))
    assert ranks[0] == dict.fromkeys(backends.BACKEND_NAMES, (0, 1))
    options = cli.parse_options(["--all-backends"])
    assert all_backends.launch_flags("deepep_v1", 1, options) == [
        "--nproc-per-node", "2", "--ranks-per-gpu", "2"
    ]  # fmt: skip
    assert all_backends.launch_flags("deepep_v2", 1, options) == []
    assert all_backends.launch_flags("deepep_v1", 0, options) == []
    given = cli.parse_options(["--all-backends", "--nproc-per-node", "4"])
    assert all_backends.launch_flags("deepep_v1", 1, given) == []


def test_the_registry_says_what_deepep_v1s_adapter_runs_at() -> None:
    """The ranks --all-backends starts DeepEP v1 at are the ones its adapter accepts."""
    from ep_image.probes._adapters.buffer import DeepEPv1Backend

    assert backends.spec("deepep_v1").world_sizes == DeepEPv1Backend.world_sizes
