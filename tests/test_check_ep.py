"""check_ep on real process groups: gloo over 1, 2 and 4 CPU processes.

Why these tests: the probe is what tells a GPU image "works" from "imports", so it must catch
real failure shapes. Every check runs here against the torch reference backend on a genuine
multi-process group, and deliberately broken backends (tests/fixtures/broken_backends.py)
are injected through the probe's own --backend-class interface; each must be caught with
exit 1 at the right step. Missing, unusable, skipped and bad-usage paths are checked through
the real command line, with fake deep_ep installs only where a real one cannot exist here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
from conftest import BROKEN, ROOT, assert_unwritable_report_is_bad_usage, clean_env, run_probe_in
from fake_installs import fake_deep_ep

from ep_image import backends
from ep_image.probes import _backend_detect
from ep_image.probes._ranks.layer import CPU_DEFAULTS
from ep_image.probes._report import Status
from ep_image.probes.check_ep.scenarios.catalogue import NAMES as SCENARIOS
from ep_image.probes.check_ep.steps import STEP_NAMES

PROBE = "ep_image.probes.check_ep"

# A small layer keeps 4 ranks on 2 cores fast; every check still runs on it.
SMALL = ["--tokens", "64", "--hidden", "64", "--experts", "16", "--topk", "4"]
QUICK = ["--iters", "3", "--warmup", "1", "--replays", "2", "--timeout", "120"]
# The steps that must pass before the checks run.
GATES = ("import", "prerequisites", "buffer")

needs_no_gpu = pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="checks the no-GPU paths"
)


def run_probe(
    tmp_path: Path,
    *args: str,
    nproc: int = 0,
    env: dict[str, str] | None = None,
    timeout: int = 300,
) -> tuple[subprocess.CompletedProcess[str], dict | None]:
    extra = ["--nproc-per-node", str(nproc)] if nproc else []
    run = run_probe_in(tmp_path, "check_ep.py", *args, *extra, env=env, timeout=timeout)
    return run.proc, run.report


def statuses(report: dict) -> dict[str, str]:
    return {step["name"]: step["status"] for step in report["steps"]}


def failed_steps(report: dict) -> list[str]:
    return [s["name"] for s in report["steps"] if s["status"] == "fail"]


def step(report: dict, name: str) -> dict:
    return next(s for s in report["steps"] if s["name"] == name)


# ---------------------------------------------------------------------------------------
# The torch reference backend passes every check, on 1, 2 and 4 ranks
# ---------------------------------------------------------------------------------------


def assert_all_passed(report: dict, world: int, tokens: int, experts: int, topk: int) -> None:
    assert report["exit_code"] == 0, report
    assert report["result"] == "passed"
    assert report["world_size"] == world
    assert list(statuses(report)) == list(STEP_NAMES)
    assert set(statuses(report).values()) == {"pass"}, statuses(report)
    for s in report["steps"]:
        assert s["seconds"] >= 0 and isinstance(s["detail"], str) and s["detail"]
    n = report["numbers"]
    # Received counts equal the reference's, rank by rank.
    assert n["received_per_rank"] == n["expected_per_rank"]
    assert len(n["received_per_rank"]) == world
    # Independent of the probe's reference: every (token, expert) pair is received once.
    assert len(n["received_per_expert"]) == experts
    assert sum(n["received_per_expert"]) == world * tokens * topk
    # A token reaches each rank at most once, and at least one rank.
    assert world * tokens <= sum(n["received_per_rank"]) <= world * tokens * min(topk, world)
    # The inputs are exact (docs/probes.md): every combined token and gradient equals the
    # reference bit for bit, at any world size.
    assert n["tolerance"] == 0.0
    assert n["max_rel_diff"] == 0.0 and n["max_grad_rel_diff"] == 0.0
    # Every scenario ran and passed on every rank.
    assert n["scenarios"] == {name: "pass" for name in SCENARIOS}, n["scenarios"]
    assert n["replay_rows_per_call"] == [
        [r] * len(calls)
        for r, calls in zip(n["received_per_rank"], n["replay_rows_per_call"], strict=True)
    ]
    for key in ("dispatch_gbs", "combine_gbs", "copy_gbs"):
        assert n[key] > 0, key
    assert n["dispatch_vs_copy"] > 0
    assert report["versions"]["torch"]
    assert report["backend"] == "torch"
    # The venv it ran in (the test runner's, no make_venv record) and nothing from outside it.
    environment = report["environment"]
    assert environment["prefix"] == sys.prefix and environment["record"] is None
    assert environment["loaded_outside_venv"] == {"shared_objects": [], "modules": []}


def test_torch_backend_passes_in_a_plain_process(tmp_path: Path) -> None:
    proc, report = run_probe(tmp_path, "--backend", "torch", *QUICK)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    d = CPU_DEFAULTS
    assert_all_passed(report, 1, d["tokens"], d["experts"], d["topk"])
    assert report["dtype"] == "float32" and report["numbers"]["tolerance"] == 0.0
    # The human table, DeepEP-test style, on stdout.
    assert "dispatch_combine  pass" in proc.stdout
    assert "result: passed (exit 0)" in proc.stdout
    assert f"report: {tmp_path / 'report.json'}" in proc.stdout.splitlines()[-1]
    assert "Traceback" not in proc.stderr
    # One rank: every token stays on its device, so its GB/s are no link's.
    bandwidth = step(report, "bandwidth")
    assert bandwidth["detail"].startswith("one rank: no link crossed, not a link figure: ")
    assert bandwidth["data"]["link_figure"] is False


@pytest.mark.parametrize("world", [2, 4])
def test_torch_backend_passes_over_gloo(tmp_path: Path, world: int) -> None:
    proc, report = run_probe(tmp_path, "--backend", "torch", *SMALL, *QUICK, nproc=world)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_all_passed(report, world, 64, 16, 4)
    # The table and where the report went are printed once (rank 0), not once per rank.
    assert proc.stdout.count("result: passed") == 1
    assert proc.stdout.count("report: ") == 1
    assert "not a link figure" not in step(report, "bandwidth")["detail"]


def test_torch_backend_bf16_under_torchrun(tmp_path: Path) -> None:
    """The real torchrun launcher: env:// rendezvous, bf16 tolerance, exit 0."""
    report = tmp_path / "report.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "-m", PROBE, "--dtype", "bfloat16", *SMALL, *QUICK, "--json", str(report),
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env=clean_env(), cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(report.read_text())
    assert_all_passed(data, 2, 64, 16, 4)
    assert data["dtype"] == "bfloat16" and data["numbers"]["tolerance"] == 0.0


# ---------------------------------------------------------------------------------------
# Broken backends are caught, with exit 1, at the right step
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "world", "expect_failed", "only", "phrase"),
    [
        ("WrongCombine", 4, "dispatch_combine", None, "does not return the top-k weighted sum"),
        ("LostTokens", 2, "dispatch_combine", None, "expected"),
        # The precision step and every scenario dispatch again, so the changing shapes show
        # there too.
        (
            "NondeterministicRouting",
            2,
            "replay",
            ["replay", "precision", "scenarios"],
            "different shapes",
        ),
        # The precision step and every scenario check combine_backward on its own.
        ("WrongGradient", 2, "backward", ["backward", "precision", "scenarios"], "gradient"),
    ],
)
def test_broken_backend_is_caught(
    tmp_path: Path,
    cls: str,
    world: int,
    expect_failed: str,
    only: list[str] | None,
    phrase: str,
) -> None:
    proc, report = run_probe(
        tmp_path, "--backend-class", f"{BROKEN}:{cls}", *SMALL, *QUICK, nproc=world
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert report["exit_code"] == 1 and report["result"] == "failed"
    failed = failed_steps(report)
    assert failed, statuses(report)
    assert failed[0] == expect_failed, statuses(report)
    if only:
        assert failed == only, statuses(report)
    assert phrase in step(report, expect_failed)["detail"]
    assert step(report, expect_failed)["hint"]
    # The gates passed: the fault is in the numbers, not in the set-up.
    for gate in GATES:
        assert step(report, gate)["status"] == "pass"
    assert "fix:" in proc.stdout and "result: failed (exit 1)" in proc.stdout
    if cls == "LostTokens":  # one token short on every rank, and the table says which rank
        n = report["numbers"]
        short = [e - r for r, e in zip(n["received_per_rank"], n["expected_per_rank"], strict=True)]
        assert short == [1] * world
        assert step(report, "dispatch_combine")["detail"].startswith("rank 0: received")


def test_backend_that_raises_is_unusable(tmp_path: Path) -> None:
    proc, report = run_probe(
        tmp_path, "--backend-class", f"{BROKEN}:RaisesInDispatch", *SMALL, *QUICK, nproc=2
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    s = statuses(report)
    assert s["buffer"] == "pass" and s["dispatch_combine"] == "error"
    assert all(s[name] == "not run" for name in ("backward", "replay", "scenarios", "bandwidth"))
    assert "simulated kernel fault" in step(report, "dispatch_combine")["detail"]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("world", [1, 2])
def test_backend_that_segfaults_is_reported_not_inherited(tmp_path: Path, world: int) -> None:
    """A crash in native code (HybridEP's constructor did this on a GPU) still gives a report."""
    proc, report = run_probe(
        tmp_path, "--backend-class", f"{BROKEN}:SegfaultsInBuffer", *SMALL, *QUICK, nproc=world
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert report is not None, "the supervisor must still write the JSON report"
    s = statuses(report)
    assert s["import"] == s["prerequisites"] == "pass"
    assert s["buffer"] == "error"
    assert all(s[n] == "not run" for n in STEP_NAMES[3:])
    detail = step(report, "buffer")["detail"]
    assert "died with SIGSEGV during buffer" in detail
    assert "broken_backends.py" in detail and "in create" in detail
    assert "native code" in step(report, "buffer")["hint"]
    assert "Fatal Python error: Segmentation fault" in proc.stderr  # the stack, for the report
    assert "result: unusable (exit 3)" in proc.stdout


# ---------------------------------------------------------------------------------------
# Missing, skipped, required
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["deepep_v1", "deepep_v2", "hybridep"])
def test_requested_backend_missing(tmp_path: Path, backend: str) -> None:
    proc, report = run_probe(tmp_path, "--backend", backend)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    imp = step(report, "import")
    assert imp["status"] == "missing"
    assert f"{backend} requested but not installed" in imp["detail"]
    assert f"use-ep {backend}" in imp["hint"] and f"--extra {backend}" in imp["hint"]
    assert all(s["status"] == "not run" for s in report["steps"][1:])
    assert "result: missing (exit 4)" in proc.stdout


@needs_no_gpu
def test_gpu_only_backend_without_gpu_is_skipped(tmp_path: Path) -> None:
    proc, report = run_probe(tmp_path, "--backend-class", f"{BROKEN}:GpuOnly")
    assert proc.returncode == 5, proc.stdout + proc.stderr
    pre = step(report, "prerequisites")
    assert pre["status"] == "skip"
    assert pre["hint"] == "no GPU visible: run on a GPU node or pass --backend torch"
    assert report["result"] == "skipped"
    # The header names the device and the shape this run actually has, not the GPU default.
    d = CPU_DEFAULTS
    assert report["device"] == "cpu" and report["shape"] == d
    assert f"tokens/rank {d['tokens']}, hidden {d['hidden']}, experts {d['experts']}" in (
        proc.stdout
    )


@needs_no_gpu
def test_require_turns_a_skip_into_a_failure(tmp_path: Path) -> None:
    proc, report = run_probe(tmp_path, "--backend-class", f"{BROKEN}:GpuOnly", "--require", nproc=2)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert report["exit_code"] == 1 and report["require"] is True
    assert step(report, "prerequisites")["status"] == "skip"


# ---------------------------------------------------------------------------------------
# Installed but unusable: fake deep_ep installs reproduce the real failure messages
# ---------------------------------------------------------------------------------------


V2_NCCL_TOO_OLD = """\
raise ImportError(
    "/site/deep_ep/_C.cpython-311-x86_64-linux-gnu.so: undefined symbol: ncclCommQueryProperties"
)
"""

ABORTS = """\
import os, sys
sys.stderr.write("Duplicate NCCL runtime found in the current system\\n")
sys.stderr.flush()
os.abort()
"""


def test_v2_with_old_nccl_is_unusable_with_the_fix_named(tmp_path: Path) -> None:
    site = fake_deep_ep(
        tmp_path / "site", "sgl-deep-ep", "0.1.2.post1", ["buffers/elastic.py"], V2_NCCL_TOO_OLD,
        build_info="EXPECTED_CUDA_MAJOR = 13\nCUDA_TAG = 'cu130'\n",
    )  # fmt: skip
    proc, report = run_probe(tmp_path, env=clean_env(PYTHONPATH=str(site)))
    assert proc.returncode == 3, proc.stdout + proc.stderr
    imp = step(report, "import")
    assert imp["status"] == "error"
    assert "ncclCommQueryProperties" in imp["detail"]
    assert "NCCL >= 2.30" in imp["hint"]
    assert report["backend"] == "deepep_v2"
    assert report["versions"]["backend"]["distribution"] == "sgl-deep-ep"
    assert report["versions"]["backend"]["build_info"] == {
        "EXPECTED_CUDA_MAJOR": 13,
        "CUDA_TAG": "cu130",
    }


def test_import_that_aborts_the_process_is_contained(tmp_path: Path) -> None:
    site = fake_deep_ep(
        tmp_path / "site", "tokenspeed-deepep", "2.1.0", ["buffers/elastic.py"], ABORTS
    )
    proc, report = run_probe(
        tmp_path, "--backend", "deepep_v2", env=clean_env(PYTHONPATH=str(site))
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    imp = step(report, "import")
    assert "killed the process (SIGABRT)" in imp["detail"]
    assert "Duplicate NCCL runtime" in imp["detail"]
    assert "libnccl" in imp["hint"]


def test_other_backend_installed_counts_as_missing(tmp_path: Path) -> None:
    site = fake_deep_ep(tmp_path / "site", "sgl-deep-ep", "0.1.2.post1", ["buffers/elastic.py"], "")
    proc, report = run_probe(
        tmp_path, "--backend", "deepep_v1", env=clean_env(PYTHONPATH=str(site))
    )
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "this environment holds deepep_v2" in step(report, "import")["detail"]


@needs_no_gpu
def test_v1_installed_without_gpu_is_skipped(tmp_path: Path) -> None:
    """A v1 build that imports on CPU reaches the prerequisites and is skipped there."""
    site = fake_deep_ep(
        tmp_path / "site", "tokenspeed-deepep", "1.2.1.post20251110", ["buffer.py"],
        "class Buffer:\n    pass\ntopk_idx_t = None\n",
    )  # fmt: skip
    proc, report = run_probe(tmp_path, env=clean_env(PYTHONPATH=str(site)))
    assert proc.returncode == 5, proc.stdout + proc.stderr
    assert report["backend"] == "deepep_v1"
    assert statuses(report)["import"] == "pass"
    assert step(report, "prerequisites")["hint"].startswith("no GPU visible")


# ---------------------------------------------------------------------------------------
# Bad usage: exit 2, one line, no traceback
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "nproc", "phrase"),
    [
        (["--backend", "nccl"], 0, "unknown backend 'nccl'"),
        (["--topk", "40", "--experts", "32"], 0, "--topk 40 is larger than --experts 32"),
        (["--tokens", "0"], 0, "--tokens must be a positive integer"),
        (["--hidden", "-5"], 0, "--hidden must be a positive integer"),
        (["--experts", "30"], 4, "--experts 30 is not divisible by the world size 4"),
        (["--topk", "64"], 0, "--topk 64 is larger than --experts 32"),
        (["--frobnicate"], 0, "unrecognized arguments: --frobnicate"),
        (
            ["--backend-class", f"{BROKEN}:NotABackend"],
            0,
            "is not a subclass of ep_image.probes._adapters.base.EPBackend",
        ),
        (["--backend-class", "no/such/file.py:X"], 0, "file not found"),
        (["--backend", "torch", "--dtype", "float64"], 0, "invalid choice"),
        (["--scenarios", "skewed,bogus"], 0, "--scenarios: unknown scenario 'bogus'"),
    ],
)
def test_bad_usage_is_one_line_and_exit_2(
    tmp_path: Path, args: list[str], nproc: int, phrase: str
) -> None:
    proc, report = run_probe(tmp_path, *args, nproc=nproc)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("check_ep: usage error: ")
    assert phrase in lines[0]
    assert "Traceback" not in proc.stderr
    assert report is None


@pytest.mark.parametrize("nproc", [0, 2])
def test_an_unwritable_report_path_is_bad_usage_before_any_work(tmp_path: Path, nproc: int) -> None:
    """Also with --nproc-per-node: the launcher refuses it before any rank starts."""
    extra = ["--nproc-per-node", str(nproc)] if nproc else []
    assert_unwritable_report_is_bad_usage(tmp_path, "check_ep", "--backend", "torch", *extra)


@pytest.mark.parametrize(
    ("args", "phrase"),
    [
        # The CPU layer's 32 experts: the ranks would refuse them, once all had started.
        ([], "the CPU layer's 32 experts (the default) do not split evenly over 3 ranks"),
        # The CPU layer's top-4 over 3 experts.
        (["--experts", "3"], "--topk 4 is larger than --experts 3"),
        (["--device", "cuda"], "--device cuda but no GPU is visible"),
    ],
)
@needs_no_gpu
def test_the_local_launcher_refuses_what_its_ranks_would_before_starting_any(
    tmp_path: Path, args: list[str], phrase: str
) -> None:
    """One usage line, exit 2, no rank started (no launcher output; seconds, not a start-up
    of every rank: 64 ranks on 2 cores took 160 s to say the same)."""
    proc, report = run_probe(tmp_path, "--backend", "torch", *args, nproc=3)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("check_ep: usage error: "), proc.stderr
    assert phrase in proc.stderr, proc.stderr
    assert proc.stdout == "" and report is None


def _pythons_without_torch() -> list[list[str]]:
    """Real interpreters that cannot import torch: this one without site-packages (-S), and
    the system's python3 where it has no torch (Debian's)."""
    found = [[sys.executable, "-S"]]
    system = Path("/usr/bin/python3")
    if system.exists():
        probe = subprocess.run([str(system), "-c", "import torch"], capture_output=True)
        if probe.returncode != 0:
            found.append([str(system)])
    return found


@pytest.mark.parametrize("front_door", ["module", "script"])
@pytest.mark.parametrize("nproc", [0, 2])
def test_a_python_without_torch_is_told_which_python_to_use(
    tmp_path: Path, front_door: str, nproc: int
) -> None:
    """It read "unusable (exit 3)" with the fix of a lost collective. Now: torch missing
    (exit 4), naming this python and the ones that hold the project, with its report."""
    for python in _pythons_without_torch():
        report = tmp_path / "report.json"
        report.unlink(missing_ok=True)
        target = ["-m", PROBE] if front_door == "module" else [str(ROOT / "probes/check_ep.py")]
        extra = ["--nproc-per-node", str(nproc)] if nproc else []
        proc = subprocess.run(
            [*python, *target, "--backend", "torch", *extra, "--json", str(report)],
            capture_output=True,
            text=True,
            timeout=120,
            env=clean_env(PYTHONPATH=str(ROOT)),
            cwd=tmp_path,
        )
        out = proc.stdout + proc.stderr
        assert proc.returncode == 4, (python, out)
        assert f"torch is not installed in this python ({python[0]}, Python " in proc.stdout
        assert "fix: run it with the python of an environment that holds the project" in out
        assert "scripts/make_venv.py" in out and "uv sync --extra" in out
        assert "lost a collective" not in out and "Traceback" not in out
        data = json.loads(report.read_text())
        assert data["exit_code"] == 4 and data["result"] == "missing"
        assert statuses(data)["import"] == "missing"
        assert data["world_size"] == (nproc or 1)


def test_help_reads_like_documentation() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", PROBE, "--help"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0
    for phrase in (
        "--backend",
        "--backend-class",
        "--tokens",
        "exit codes",
        "torchrun",
        "--require",
    ):
        assert phrase in proc.stdout


# ---------------------------------------------------------------------------------------
# Units: detection, import verdicts, the reference, the registry tie
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("markers", "expected"),
    [
        (["buffer.py"], "deepep_v1"),
        (["buffers/elastic.py", "buffers/legacy.py"], "deepep_v2"),
        (["buffer.py", "hybrid_ep_buffer.py"], "hybridep"),
        ([], None),
    ],
)
def test_backend_from_layout(tmp_path: Path, markers: list[str], expected: str | None) -> None:
    for marker in markers:
        (tmp_path / marker).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / marker).write_text("")
    assert _backend_detect.backend_from_layout(tmp_path) == expected


@pytest.mark.parametrize(
    ("dist", "version", "expected"),
    [
        ("tokenspeed-deepep", "1.2.1.post20251110", "deepep_v1"),
        ("tokenspeed-deepep", "2.1.0", "deepep_v2"),
        ("sgl-deep-ep", "0.1.2.post1", "deepep_v2"),
        ("sgl_deep_ep", "0.1.0", "deepep_v2"),
        ("deep-ep", "1.2.1+e0a5b1d", None),
    ],
)
def test_backend_from_distribution(dist: str, version: str, expected: str | None) -> None:
    assert _backend_detect.backend_from_distribution(dist, version) == expected


def test_detect_git_built_hybridep_with_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = fake_deep_ep(
        tmp_path, "deep_ep", "1.2.1+e0a5b1d", ["buffer.py", "hybrid_ep_buffer.py"], ""
    )
    info = site / "deep_ep-1.2.1+e0a5b1d.dist-info"
    (info / "direct_url.json").write_text(
        json.dumps(
            {
                "url": "https://github.com/deepseek-ai/DeepEP",
                "vcs_info": {"vcs": "git", "commit_id": "e0a5b1d9848ab3e7b4a67842bf06f067bfac67f8"},
            }
        )
    )
    monkeypatch.syspath_prepend(str(site))
    found = _backend_detect.detect_installed()
    assert found.backend == "hybridep"
    assert found.distribution == "deep_ep" and found.version == "1.2.1+e0a5b1d"
    assert found.commit == "e0a5b1d9848ab3e7b4a67842bf06f067bfac67f8"
    (info / "direct_url.json").unlink()
    assert _backend_detect.detect_installed().commit == "e0a5b1d"  # the +<shortsha> local version


@pytest.mark.parametrize(
    ("output", "code", "gpu", "status", "hint_phrase"),
    [
        (
            "ImportError: x.so: undefined symbol: ncclCommQueryProperties",
            1,
            True,
            Status.ERROR,
            "NCCL >= 2.30",
        ),
        (
            "AssertionError: Duplicate NCCL runtime found in the current system: a and b",
            1,
            True,
            Status.ERROR,
            "two different libnccl",
        ),
        ("", -6, True, Status.ERROR, "NCCL"),
        (
            "ImportError: libdeep.so: undefined symbol: nvshmemx_init_status",
            1,
            True,
            Status.ERROR,
            "NVSHMEM",
        ),
        (
            "ImportError: This wheel requires CUDA 13, but PyTorch uses CUDA 12. See",
            1,
            True,
            Status.ERROR,
            "cu130",
        ),
        (
            "ModuleNotFoundError: No module named 'deep_ep_cpp'",
            1,
            True,
            Status.ERROR,
            "compiled extension is missing",
        ),
        (
            "ImportError: The NVIDIA driver does not expose a usable CUDA device. See",
            1,
            False,
            Status.SKIP,
            "no GPU visible",
        ),
        (
            "AssertionError\n    assert cuda_home is not None",
            1,
            True,
            Status.ERROR,
            "set CUDA_HOME",
        ),
        ("RuntimeError: something else", 1, True, Status.ERROR, "reinstall"),
    ],
)
def test_classify_import_failure(
    output: str, code: int, gpu: bool, status: Status, hint_phrase: str
) -> None:
    got, detail, hint = _backend_detect.classify_import_failure("deepep_v2", output, code, gpu)
    assert got == status
    assert hint_phrase in hint
    assert "\n" not in detail


def test_markers_and_distributions_match_the_build_registry() -> None:
    """The probe's identity rules agree with ep_image/backends/ (one registry, two readers)."""
    registry = backends.load_registry(ROOT)
    assert tuple(registry) == _backend_detect.BACKEND_NAMES
    assert backends.layout_markers(backends.MODULE) == _backend_detect.MARKERS
    for name, backend in registry.items():
        module = backends.spec(name).module
        markers = dict(backends.layout_markers(module))
        assert backend.marker_file == f"{module.replace('.', '/')}/{markers[name]}", name
        version = backend.requirement.split("==", 1)[1] if "==" in backend.requirement else "0"
        by_dist = _backend_detect.backend_from_distribution(backend.distribution, version)
        assert by_dist in (name, None), (name, by_dist)
        assert backend.distribution in backends.known_distributions(module)


def test_merge_exit_codes() -> None:
    from ep_image.probes._report import merge_exit_codes

    assert merge_exit_codes([0, 0]) == 0
    assert merge_exit_codes([0, 5]) == 5
    assert merge_exit_codes([5, 1]) == 1
    assert merge_exit_codes([1, 3]) == 3
    assert merge_exit_codes([3, 4, 0]) == 4
    assert merge_exit_codes([0, -9]) == 3  # a rank killed by a signal
    assert merge_exit_codes([4, 2]) == 2  # bad usage: nothing was checked


def test_reference_catches_swapped_payload_and_wrong_expert() -> None:
    """check_dispatch, fed by hand: exact input passes, each single fault is named."""
    import torch

    from ep_image.probes._adapters.base import Dispatched, Shape
    from ep_image.probes.check_ep.reference import (
        GlobalRouting,
        check_dispatch,
        expected_for_rank,
        make_inputs,
    )

    cpu = torch.device("cpu")
    shape = Shape(tokens=16, hidden=16, experts=8, topk=2, dtype=torch.float32, device=cpu)
    ranks = [make_inputs(shape, rank=r, seed=1) for r in range(2)]
    g = GlobalRouting(
        x=torch.cat([r.x for r in ranks]),
        topk_idx=torch.cat([r.topk_idx for r in ranks]),
        topk_weights=torch.cat([r.topk_weights for r in ranks]),
        counts=[16, 16],
        world=2,
    )
    exp = expected_for_rank(g, rank=1, local=4)
    rows, lo = exp.rows, 4
    ours = (g.topk_idx[rows] >= lo) & (g.topk_idx[rows] < lo + 4)
    idx = torch.where(ours, g.topk_idx[rows] - lo, -1)

    def received(x=None, topk_idx=None, per_expert=None) -> Dispatched:
        return Dispatched(
            (g.x[rows] if x is None else x).clone(),
            (idx if topk_idx is None else topk_idx).clone(),
            g.topk_weights[rows].clone(),
            exp.per_expert if per_expert is None else per_expert,
            None,
        )

    assert check_dispatch(received(), g, exp, 4).problems == []
    # Order does not matter: rows may arrive in any order.
    rev = torch.arange(rows.numel() - 1, -1, -1)
    shuffled = received(x=g.x[rows][rev], topk_idx=idx[rev])
    shuffled.recv_topk_weights = g.topk_weights[rows][rev]
    assert check_dispatch(shuffled, g, exp, 4).problems == []

    corrupted = received()
    corrupted.recv_x[0, 5] += 1
    assert "payloads differ" in check_dispatch(corrupted, g, exp, 4).problems[0]

    wrong_expert = received()
    col = int((wrong_expert.recv_topk_idx[0] >= 0).nonzero()[0])
    wrong_expert.recv_topk_idx[0, col] = (wrong_expert.recv_topk_idx[0, col] + 1) % 4
    problems = check_dispatch(wrong_expert, g, exp, 4).problems
    assert any("wrong local experts" in p for p in problems), problems

    lost = received(x=g.x[rows][1:], topk_idx=idx[1:])
    lost.recv_topk_weights = lost.recv_topk_weights[1:]
    problems = check_dispatch(lost, g, exp, 4).problems
    assert problems[0].startswith(f"received {rows.numel() - 1} tokens, expected {rows.numel()}")

    miscounted = received(per_expert=[c + 1 for c in exp.per_expert])
    assert "local expert 0 received" in check_dispatch(miscounted, g, exp, 4).problems[0]


def test_hybridep_routing_map_conversion() -> None:
    """The HybridEP adapter's map -> top-k conversion (pure torch, so it is testable here)."""
    import torch

    from ep_image.probes._adapters.hybrid_ep_buffer import _routing_map_to_topk

    routing = torch.tensor([[True, False, True], [False, False, True], [False, False, False]])
    probs = torch.tensor([[0.5, 0.0, 0.25], [0.0, 0.0, 0.75], [0.0, 0.0, 0.0]])
    idx, w = _routing_map_to_topk(routing, probs, topk=4)
    assert idx.tolist() == [[0, 2, -1, -1], [2, -1, -1, -1], [-1, -1, -1, -1]]
    assert w.tolist() == [[0.5, 0.25, 0.0, 0.0], [0.75, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]


def test_file_contains_finds_needles_across_chunk_borders(tmp_path: Path) -> None:
    """How the probe tells a v1 build with NVSHMEM (links libnvshmem_host) from one without."""
    from ep_image.probes import _installed

    lib = tmp_path / "deep_ep_cpp.so"
    lib.write_bytes(b"\0" * 10 + b"libnvshmem_host.so.3" + b"\0" * 10)
    for chunk in (4, 7, 16, 1 << 20):
        assert _installed.file_contains(str(lib), b"libnvshmem_host", chunk=chunk)
    assert not _installed.file_contains(str(lib), b"libnccl", chunk=8)
    assert not _installed.file_contains(str(tmp_path / "absent.so"), b"x")


def test_deepep_v2_reports_its_jit_cache_and_gin_setting(tmp_path: Path) -> None:
    """DeepEP v2 compiles its kernels at first dispatch into EP_JIT_CACHE_DIR (~/.deep_ep): the
    report says where, whether it was warm, and whether GIN was turned off (measured on the
    H200: 36 s cold, 21 s warm, docs/probe-results.md)."""
    from ep_image.probes._adapters.elastic_buffer import jit_cache_facts
    from ep_image.probes._ranks import gates

    cache = tmp_path / "jit"
    (cache / "kernels").mkdir(parents=True)
    (cache / "kernels" / "a.cubin").write_bytes(b"x" * 10)
    (cache / "b.so").write_bytes(b"y" * 5)
    facts = jit_cache_facts({"EP_JIT_CACHE_DIR": str(cache), "EP_DISABLE_GIN": "1"})
    assert facts["jit_cache_dir"] == str(cache) and facts["jit_cache_from"] == "EP_JIT_CACHE_DIR"
    assert (facts["jit_cache_files_before"], facts["jit_cache_bytes_before"]) == (2, 15)
    assert facts["gin"].startswith("disabled")
    default = jit_cache_facts({"HOME": str(tmp_path)})
    assert default["jit_cache_dir"].endswith("/.deep_ep") and default["gin"] == "enabled"
    assert default["jit_cache_files_before"] == 0

    sel = types.SimpleNamespace(name="deepep_v2", custom=False)
    detail = gates._import_detail(sel, {"distribution": "deep-ep", "version": "2.0.0", **default})
    assert "(empty: the first dispatch compiles)" in detail and "NCCL GIN enabled" in detail
    detail = gates._import_detail(sel, {"distribution": "deep-ep", "version": "2.0.0", **facts})
    assert "(2 files: reused)" in detail


def test_a_backend_class_file_may_define_dataclasses(tmp_path: Path) -> None:
    """A --backend-class file is loaded as an import loads a module: a @dataclass in it (which
    looks its module up while it is made) works."""
    source = tmp_path / "dataclass_backend.py"
    source.write_text(
        "from __future__ import annotations\n"
        "import dataclasses\n"
        "from ep_image.probes._adapters.torch_reference import TorchBackend\n"
        "@dataclasses.dataclass\n"
        "class Tally:\n"
        "    calls: int = 0\n"
        "class WithTally(TorchBackend):\n"
        "    name = 'with_tally'\n"
        "    tally = Tally()\n"
    )
    proc, report = run_probe(
        tmp_path, "--backend-class", f"{source}:WithTally", *SMALL, *QUICK, "--scenarios", "none"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["backend"] == "with_tally"
