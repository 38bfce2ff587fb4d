"""upstream_test.py's report says which venv the oracle ran in and what its processes loaded.

A stand-in upstream test (its own tests/ folder, as a DeepEP checkout has) starts ranks with
multiprocessing's spawn, as DeepEP's tests do through torch.multiprocessing, and one rank
imports a module from outside the venv: the report must list it, from the rank that loaded it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import assert_unwritable_report_is_bad_usage

TEST = """
import argparse, multiprocessing as mp, sys


def rank(index, outside):
    if index == 1:
        sys.path.insert(0, outside)
        import machine_torch  # noqa: F401


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-processes", type=int)
    args = parser.parse_args()
    context = mp.get_context("spawn")
    procs = [context.Process(target=rank, args=(i, {outside!r})) for i in range(args.num_processes)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    print("passed")
    sys.exit(max(p.exitcode for p in procs))
"""


def test_the_oracles_processes_report_what_they_loaded(tmp_path: Path) -> None:
    outside = tmp_path / "machine"
    (outside / "machine_torch").mkdir(parents=True)
    (outside / "machine_torch" / "__init__.py").write_text("")
    tests = tmp_path / "DeepEP" / "tests"
    tests.mkdir(parents=True)
    (tests / "utils.py").write_text("def init_dist(local_rank, num_local_ranks):\n    pass\n")
    (tests / "test_intranode.py").write_text(TEST.format(outside=str(outside)))
    report = tmp_path / "upstream.json"
    cmd = [sys.executable, "-m", "ep_image.probes.upstream_test", "--backend", "deepep_v1",
           "--tests", str(tests), "--num-processes", "2", "--json", str(report)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(report.read_text())
    assert data["result"] == "passed"
    environment = data["environment"]
    assert environment["prefix"] == sys.prefix and environment["python"] == sys.executable
    loaded = environment["loaded_outside_venv"]
    assert loaded["processes"] >= 3, loaded  # the test's main process and its two ranks
    assert [m.split(":")[0] for m in loaded["modules"]] == ["machine_torch"], loaded
    assert not any("sitecustomize" in m or "utils" in m for m in loaded["modules"])


def test_an_unwritable_report_path_is_bad_usage(tmp_path: Path) -> None:
    """Found before the test runs, so a run of minutes never ends without its verdict."""
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_intranode.py").write_text("raise SystemExit('must not run')\n")
    assert_unwritable_report_is_bad_usage(
        tmp_path, "upstream_test", "--backend", "deepep_v1", "--tests", str(tests)
    )


def test_cases_completed_is_never_below_cases_passed() -> None:
    """DeepEP v1's test prints "passed" per case and announces none: its reports read
    cases_passed 24 beside cases_completed 0. DeepEP v2's announces each case and prints no
    "passed"; a cut-off last case is not completed."""
    from ep_image.probes.upstream_test import cases_completed, cases_passed

    v1 = "[testing] Running with BF16, with top-k ... passed\n" * 24
    assert (cases_passed(v1, True), cases_completed(v1, True)) == (24, 24)
    v2 = "> Testing with num_tokens=128\n" * 144
    assert (cases_passed(v2, True), cases_completed(v2, True)) == (144, 144)
    assert (cases_passed(v2, False), cases_completed(v2, False)) == (143, 143)
