"""check_ep against backends that fail the way real kernels do: every one must end
with the right non-zero code *and* a table and JSON report from rank 0.

Why these tests: each fault here once got past the probe - an exit with status 0 in the
middle of dispatch passed, a rank that died under torchrun left no report, a hanging buffer
never timed out, one lost token hid under a whole-tensor tolerance, and a race that corrupts
back-to-back calls went unseen because replays compared shapes only. The backends are the
torch reference with one fault each (tests/fixtures/broken_backends.py), run on real gloo
process groups; the placement rules that decide where ranks run are tested as the pure
decision they are.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from conftest import BROKEN, clean_env, run_probe_in

SMALL = ["--tokens", "64", "--hidden", "64", "--experts", "16", "--topk", "4"]
QUICK = ["--iters", "3", "--warmup", "1", "--replays", "2", "--timeout", "120"]
DEEPSEEK_V3 = ["--tokens", "4096", "--hidden", "7168", "--experts", "256", "--topk", "8"]


def backend(cls: str) -> list[str]:
    return ["--backend-class", f"{BROKEN}:{cls}"]


@pytest.mark.parametrize("cls", ["OsExitZeroInDispatch", "SysExitZeroInDispatch"])
@pytest.mark.parametrize("world", [1, 2])
def test_exit_with_status_0_mid_dispatch_is_unusable(check_ep, cls: str, world: int) -> None:
    run = check_ep(*backend(cls), *SMALL, *QUICK, nproc=world if world > 1 else 0)
    assert run.proc.returncode == 3, run.output
    assert run.report is not None and run.report["exit_code"] == 3
    assert run.statuses()["dispatch_combine"] == "error"
    detail = run.step("dispatch_combine")["detail"]
    if cls == "OsExitZeroInDispatch":
        assert "exited with status 0 during dispatch_combine without a verdict" in detail
    else:
        assert "sys.exit(0) during dispatch_combine" in detail
    assert run.proc.stdout.count("result: unusable (exit 3)") == 1


@pytest.mark.parametrize(
    ("cls", "phrase"),
    [
        ("SigkillOnRankOne", "rank 1 died with SIGKILL during dispatch_combine"),
        ("SegfaultOnRankOne", "rank 1 died with SIGSEGV during dispatch_combine"),
        ("ExitsSevenOnRankOne", "rank 1 exited with status 7 during dispatch_combine"),
    ],
)
def test_a_rank_other_than_0_dying_under_torchrun_is_reported_by_rank_0(
    check_ep, cls: str, phrase: str
) -> None:
    run = check_ep(*backend(cls), *SMALL, *QUICK, torchrun=2)
    assert run.proc.returncode != 0, run.output  # torchrun turns every failure into 1
    assert run.report is not None, "rank 0 must still write the JSON report\n" + run.output
    assert run.report["exit_code"] == 3 and run.report["result"] == "unusable"
    assert phrase in run.step("dispatch_combine")["detail"], run.step("dispatch_combine")
    assert [s for s, v in run.statuses().items() if v == "pass"] == [
        "import",
        "prerequisites",
        "buffer",
    ]
    assert run.proc.stdout.count("result: unusable (exit 3)") == 1
    failure = run.step("dispatch_combine")["data"]["failure"]
    assert failure["rank"] == 1


def test_a_buffer_that_hangs_ends_within_the_timeout_and_names_the_step(check_ep) -> None:
    start = time.monotonic()
    run = check_ep(*backend("HangsInBuffer"), *SMALL, "--timeout", "20", nproc=2)
    elapsed = time.monotonic() - start
    assert run.proc.returncode == 3, run.output
    assert elapsed < 20 + 60, elapsed  # start-up and teardown on a loaded 2-core machine
    s = run.statuses()
    assert s["buffer"] == "error" and s["dispatch_combine"] == "not run"
    detail = run.step("buffer")["detail"]
    assert "buffer did not finish within 20 s" in detail
    assert "broken_backends.py" in detail and "in create" in detail  # where it was stuck
    assert "Current thread" in run.proc.stderr or "Thread 0x" in run.proc.stderr  # the stacks
    assert run.proc.stdout.count("result: unusable (exit 3)") == 1


def test_one_lost_token_fails_at_the_deepseek_v3_shape_in_bf16(check_ep) -> None:
    """One zeroed token of 4096 moves the whole-tensor difference by about 1/64; per token it
    differs by 1, and the bound is 0 (the inputs are exact)."""
    fast = ["--iters", "1", "--warmup", "0", "--replays", "1", "--timeout", "300"]
    fast += ["--scenarios", "none"]  # the layer-shape step is the point here
    run = check_ep(*backend("LosesOneTokenInCombine"), *DEEPSEEK_V3, "--dtype", "bfloat16", *fast)
    assert run.proc.returncode == 1, run.output
    dc = run.step("dispatch_combine")
    assert dc["status"] == "fail"
    assert "1 of 4096 tokens differ" in dc["detail"] and "token 2048" in dc["detail"]
    # Over the whole tensor the lost token is diluted to about 1/sqrt(tokens).
    assert dc["data"]["rel_diff"] == 1.0 and dc["data"]["global_rel_diff"] < 0.02


@pytest.mark.parametrize(
    ("cls", "failed", "extra"),
    [
        ("CorruptsFromThirdDispatch", ["replay", "precision", "bandwidth", "scenarios"], []),
        ("CorruptsTimedDispatches", ["bandwidth"], []),
        ("CorruptsTimedCombines", ["bandwidth"], ["--iters", "5"]),
    ],
)
def test_data_corrupted_by_back_to_back_calls_fails(
    check_ep, cls: str, failed: list[str], extra: list[str]
) -> None:
    run = check_ep(*backend(cls), *SMALL, *QUICK, *extra, nproc=2)
    assert run.proc.returncode == 1, run.output
    assert [name for name, status in run.statuses().items() if status == "fail"] == failed
    assert run.step("dispatch_combine")["status"] == "pass"
    if "replay" in failed:
        assert "wrong tokens or payloads on calls [0, 1, 2]" in run.step("replay")["detail"]
    assert "back-to-back" in run.step("bandwidth")["detail"]


# ---------------------------------------------------------------------------------------
# Ranks in step: a check that fails on one rank never leaves a peer waiting
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "failed"),
    [
        # The probe raised on rank 0 reading the counts, and rank 1 waited in combine.
        ("CountsNotAListOnRankZero", ["dispatch_combine", "replay", "precision", "scenarios"]),
        # The composite gradient could not be formed on rank 0, and rank 1 waited in
        # combine_backward.
        (
            "CombineOneTokenShortOnRankZero",
            ["dispatch_combine", "backward", "precision", "bandwidth", "scenarios"],
        ),
    ],
)
def test_wrong_output_on_one_rank_fails_in_seconds_with_every_check_named(
    check_ep, cls: str, failed: list[str]
) -> None:
    """Wrong numbers on one rank are exit 1 with every check's verdict, long before the
    timeout: every rank makes the same calls whatever its own checks found."""
    start = time.monotonic()
    run = check_ep(*backend(cls), *SMALL, *QUICK[:-2], "--timeout", "60", nproc=2)
    elapsed = time.monotonic() - start
    assert run.proc.returncode == 1, run.output
    assert elapsed < 60, elapsed  # the old probe waited out --timeout, then said exit 3
    statuses = run.statuses()
    assert [n for n, s in statuses.items() if s == "fail"] == failed, statuses
    assert set(statuses.values()) == {"pass", "fail"}, statuses  # every step reached a verdict
    assert run.step(failed[0])["detail"].startswith("rank 0: "), run.step(failed[0])


@pytest.mark.parametrize(
    ("cls", "step", "phrase", "waiting", "code"),
    [
        # Rank 1 receives nothing in the skewed scenario and raises there alone; it had
        # returned wrong rows before (every check failed), so the verdict stays "failed".
        (
            "RaisesWhereNothingArrives",
            "scenarios",
            "rank 1: changing failed (seed 2951406247): layout 0 dispatch: received",
            [0],
            1,
        ),
        (
            "RaisesInCombineOnRankZero",
            "dispatch_combine",
            "rank 0: RuntimeError: simulated",
            [1],
            3,
        ),
    ],
)
def test_a_backend_raising_on_one_rank_ends_in_seconds_naming_rank_and_error(
    check_ep, cls: str, step: str, phrase: str, waiting: list[int], code: int
) -> None:
    """The raising rank stops waiting for peers blocked in the collective it skipped; the
    supervisors stop those, and rank 0 reports the error (exit 3, or 1 after wrong numbers)
    instead of a hang."""
    start = time.monotonic()
    run = check_ep(*backend(cls), *SMALL, *QUICK[:-2], "--timeout", "60", nproc=2)
    elapsed = time.monotonic() - start
    assert run.proc.returncode == code, run.output
    assert elapsed < 60, elapsed
    assert run.report is not None and run.report["exit_code"] == code, run.output
    statuses = run.statuses()
    assert statuses[step] == "error"
    detail = run.step(step)["detail"]
    assert detail.startswith(phrase), detail
    assert f"ranks {waiting} never reached the end of the step" in detail
    assert "did not finish within" not in detail
    if cls == "RaisesWhereNothingArrives":
        assert "skewed stopped (seed 3716537303): layout 0 dispatch raised IndexError" in detail
        assert statuses["dispatch_combine"] == statuses["replay"] == "fail"  # still named
    word = {1: "failed", 3: "unusable"}[code]
    assert run.proc.stdout.count(f"result: {word} (exit {code})") == 1


def test_a_nan_kept_by_a_layout_is_not_reported_as_changed(check_ep) -> None:
    """An output that held a NaN when returned and still does has not changed: only the NaN
    is reported (NaN != NaN made it read as memory the backend reused)."""
    run = check_ep(*backend("NaNInOneToken"), *SMALL, *QUICK, "--scenarios", "changing")
    assert run.proc.returncode == 1, run.output
    problems = run.step("scenarios")["data"]["scenarios"][0]["problems"]
    assert problems and all("changed after later calls" not in p for p in problems), problems


# ---------------------------------------------------------------------------------------
# Placement: where each rank runs, decided the same way on every rank
# ---------------------------------------------------------------------------------------


def facts(*views: tuple[int, str | None]) -> list[dict]:
    """One rank per (visible GPUs, UUID of the GPU it would use)."""
    out = []
    for rank, (gpus, uuid) in enumerate(views):
        fact = {"rank": rank, "host": "node", "gpus": gpus}
        if gpus:
            fact.update(index=0, uuid=uuid)
        out.append(fact)
    return out


def test_one_gpu_per_rank_bound_by_slurm_runs_every_rank_on_its_gpu() -> None:
    """Eight ranks each seeing one GPU as cuda:0: eight different GPUs, NCCL, none on CPU.

    The probe used to put every rank whose LOCAL_RANK was past the visible GPU count on the
    CPU: here ranks 1-7, which then handed host tensors to a GPU backend.
    """
    from ep_image.probes._ranks.runtime import decide_placement

    views = facts(*[(1, f"GPU-{i}") for i in range(8)])
    for rank in range(8):
        place = decide_placement(views, rank, wants_gpu=True, ranks_per_gpu=1)
        assert place.use_gpu and place.gpu_index == 0 and not place.shared, (rank, place)
        assert place.group_backend == "nccl" and place.problem is None


def test_ranks_sharing_a_gpu_need_the_flag_and_then_use_gloo() -> None:
    from ep_image.probes._ranks.runtime import decide_placement

    views = facts((1, "GPU-0"), (1, "GPU-0"))
    refused = decide_placement(views, 1, wants_gpu=True, ranks_per_gpu=1)
    assert not refused.use_gpu and refused.problem is not None
    detail, hint = refused.problem
    assert "ranks [0, 1] share one GPU" in detail
    assert "--ranks-per-gpu 2" in hint
    shared = decide_placement(views, 1, wants_gpu=True, ranks_per_gpu=2)
    assert shared.use_gpu and shared.shared and shared.group_backend == "gloo"
    crowded = decide_placement(facts(*[(1, "GPU-0")] * 4), 0, wants_gpu=True, ranks_per_gpu=2)
    assert "raise --ranks-per-gpu to 4" in crowded.problem[1]


def test_a_rank_without_a_gpu_stops_every_rank_instead_of_running_alone_on_cpu() -> None:
    from ep_image.probes._ranks.runtime import decide_placement

    views = facts((1, "GPU-0"), (0, None))
    for rank in (0, 1):
        place = decide_placement(views, rank, wants_gpu=True, ranks_per_gpu=1)
        assert not place.use_gpu and place.problem is not None
        assert "ranks [1] see no GPU" in place.problem[0]


def test_eight_ranks_on_eight_visible_gpus_are_exclusive() -> None:
    from ep_image.probes._ranks.runtime import decide_placement

    views = [{"rank": r, "host": "n", "gpus": 8, "index": r, "uuid": f"GPU-{r}"} for r in range(8)]
    place = decide_placement(views, 5, wants_gpu=True, ranks_per_gpu=1)
    assert place.use_gpu and place.gpu_index == 5 and not place.shared


# ---------------------------------------------------------------------------------------
# The oracle's adaptation and the NCCL version the probe judges by
# ---------------------------------------------------------------------------------------


UTILS = """import os
import torch
import torch.distributed as dist


def init_dist(local_rank: int, num_local_ranks: int):
    # NOTES: you may rewrite this function with your own cluster settings
    dist.init_process_group(backend='nccl', world_size=num_local_ranks, rank=local_rank)
    return dist.get_rank(), dist.get_world_size(), None


def calc_diff(x, y):
    return 0.0
"""


def test_upstream_test_rewrites_only_init_dist() -> None:
    from ep_image.probes.upstream_test import SHARED_INIT_DIST, rewrite_init_dist

    out = rewrite_init_dist(UTILS)
    assert SHARED_INIT_DIST in out and "backend='nccl'" not in out
    assert out.replace(SHARED_INIT_DIST, "") == UTILS.replace(
        UTILS[UTILS.index("def init_dist") : UTILS.index("def calc_diff") - 2], ""
    )
    compile(out, "utils.py", "exec")
    with pytest.raises(SystemExit, match="no init_dist"):
        rewrite_init_dist("def other():\n    pass\n")


def test_upstream_test_refuses_a_shared_gpu_for_deepep_v2(tmp_path, capsys) -> None:
    from ep_image.probes.upstream_test import main

    (tmp_path / "elastic").mkdir()
    (tmp_path / "elastic" / "test_ep.py").write_text("")
    assert main(["--backend", "deepep_v2", "--tests", str(tmp_path), "--shared-gpu"]) == 2
    assert "NCCL refuses two ranks on one GPU" in capsys.readouterr().err


def test_the_nccl_version_is_the_loaded_librarys() -> None:
    """torch.cuda.nccl.version() is the NCCL torch was built with; the probe reads the library
    it actually loaded (on the GPU machine: 2.30.7 loaded while torch said 2.28.9)."""
    import importlib.metadata

    import torch  # loads libnccl with the CUDA build of torch

    from ep_image.probes import _torch_stack

    loaded = _torch_stack.loaded_nccl_version()
    assert loaded == importlib.metadata.version("nvidia-nccl-cu13")
    assert _torch_stack.torch_facts()["nccl"] == loaded
    assert torch.cuda.nccl.version()  # present, but not what the probe reports


@pytest.mark.parametrize(("static", "expected"), [(True, True), (False, False)])
def test_a_cxx_extension_with_its_own_libstdcxx_is_recognised(
    tmp_path, static: bool, expected: bool
) -> None:
    """HybridEP built by a compiler wrapper that adds -static-libstdc++ crashed in iostream
    code beside torch's libstdc++; the probe names such builds. Real g++ builds of both kinds."""
    import shutil
    import subprocess

    from ep_image.probes import _installed

    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed")
    src = tmp_path / "ext.cpp"
    src.write_text(
        '#include <sstream>\n#include <string>\nextern "C" int ranks(int n) {\n'
        "  std::ostringstream s; s << static_cast<long>(n); return (int)s.str().size(); }\n"
    )
    lib = tmp_path / "ext.so"
    flags = ["-static-libstdc++"] if static else []
    subprocess.run(["g++", "-shared", "-fPIC", *flags, str(src), "-o", str(lib)], check=True)
    assert _installed.static_cxx_runtime(str(lib)) is expected


def test_upstream_test_counts_cases_that_ran_through_their_checks() -> None:
    """DeepEP v2's own test prints no per-case "passed"; a case completed when the next one
    starts (its asserts come first), and a run cut off by its limit does not count the last."""
    from ep_image.probes import upstream_test

    log = "Config:\n > Ranks: 1\n" + "".join(
        f" > Testing with do_handle_copy={i} ...\n   * EP: 0/1 | dispatch: 1 GB/s\n\n"
        for i in range(3)
    )
    assert upstream_test.cases_completed(log, finished=True) == 3
    assert upstream_test.cases_completed(log, finished=False) == 2
    assert upstream_test.cases_completed("Config:\n", finished=False) == 0
    # Passed: v2's completed cases (it asserts per case); v1's own "passed" lines where printed.
    assert upstream_test.cases_passed(log, finished=False) == 2
    v1_log = "".join(f"[testing] Check dispatch ({i}) passed\n" for i in range(5))
    assert upstream_test.cases_passed(v1_log, finished=True) == 5


def test_a_buffer_that_needs_numpy_where_there_is_none_names_numpy(check_ep, tmp_path) -> None:
    """DeepEP v1 from a lock without numpy: its Buffer failed with torch's "Numpy is not
    available" on an H200. Here numpy is made unimportable for the probe's processes; the
    same backend passes where numpy imports."""
    blocker = tmp_path / "no-numpy" / "numpy"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text(
        "raise ModuleNotFoundError('numpy left out for this test')\n"
    )
    env = clean_env(PYTHONPATH=str(blocker.parent))
    run = check_ep(*backend("GathersObjectsInBuffer"), *SMALL, *QUICK, nproc=2, env=env)
    assert run.proc.returncode == 3, run.output
    buffer = run.step("buffer")
    assert "Numpy is not available" in buffer["detail"], buffer
    assert "install numpy" in buffer["hint"] and "make_venv" in buffer["hint"], buffer
    passing = check_ep(*backend("GathersObjectsInBuffer"), *SMALL, *QUICK, nproc=2)
    assert passing.proc.returncode == 0, passing.output


@pytest.mark.parametrize("mode", [0o777, 0o775])
def test_a_jit_cache_others_can_write_is_refused_before_any_kernel_runs(
    check_ep, tmp_path, mode: int
) -> None:
    """A backend that loads compiled kernels from a directory others can write (DeepEP v2's
    EP_JIT_CACHE_DIR pointing at a shared 0777 directory drew no warning): unusable, exit 3,
    at prerequisites, with the fix, and no buffer is made."""
    cache = tmp_path / "open-cache"
    cache.mkdir()
    cache.chmod(mode)
    env = clean_env(EP_TEST_JIT_CACHE=str(cache / "deep_ep"))
    run = check_ep(*backend("LoadsKernelsFromAnOpenCache"), *SMALL, *QUICK, env=env)
    assert run.proc.returncode == 3, run.output
    prereq = run.step("prerequisites")
    assert prereq["status"] == "error"
    assert f"others can write {cache}" in prereq["detail"], prereq
    assert "EP_JIT_CACHE_DIR" in prereq["hint"]
    assert run.statuses()["buffer"] == "not run"
    cache.chmod(0o755)
    assert (
        check_ep(*backend("LoadsKernelsFromAnOpenCache"), *SMALL, *QUICK, env=env).proc.returncode
        == 0
    )


def test_a_jit_cache_with_a_kernel_others_can_write_is_refused(check_ep, tmp_path) -> None:
    """Only the cache directory (or its nearest existing parent) was checked: a kernel file
    inside it that anyone can rewrite passed. The walk names it; once fixed, the run passes."""
    cache = tmp_path / "cache" / "deep_ep"
    kernel = cache / "kernels" / "k0" / "kernel.cubin"
    kernel.parent.mkdir(parents=True)
    kernel.write_bytes(b"\x7fELF planted")
    kernel.chmod(0o666)
    env = clean_env(EP_TEST_JIT_CACHE=str(cache))
    run = check_ep(*backend("LoadsKernelsFromAnOpenCache"), *SMALL, *QUICK, env=env)
    assert run.proc.returncode == 3, run.output
    prereq = run.step("prerequisites")
    assert f"others can write {kernel} (mode 0666)" in prereq["detail"], prereq
    assert "chmod go-w" in prereq["hint"] and "EP_JIT_CACHE_DIR" in prereq["hint"], prereq
    assert run.statuses()["buffer"] == "not run"
    kernel.chmod(0o644)
    passing = check_ep(*backend("LoadsKernelsFromAnOpenCache"), *SMALL, *QUICK, env=env)
    assert passing.proc.returncode == 0, passing.output
    assert passing.step("prerequisites")["data"]["jit_cache_entries_checked"] == 3


def deepep_v2_cache_check(cache_env: dict[str, str], monkeypatch: pytest.MonkeyPatch):
    """The prerequisites' cache check on DeepEP v2's own adapter, whose jit_cache_dir reads
    EP_JIT_CACHE_DIR, else ~/.deep_ep (deep_ep itself is not imported)."""
    from ep_image.probes._adapters.elastic_buffer import DeepEPv2Backend
    from ep_image.probes._ranks import gates

    monkeypatch.delenv("EP_JIT_CACHE_DIR", raising=False)
    for name, value in cache_env.items():
        monkeypatch.setenv(name, value)
    data: dict = {}
    notes: list[str] = []
    problems: list = []
    gates._check_jit_cache(DeepEPv2Backend(), data, notes, problems)
    return data, notes, problems


@pytest.mark.parametrize(
    "how", ["a kernel others can write", "a directory others can write", "another user's kernel"]
)
@pytest.mark.parametrize("where", ["EP_JIT_CACHE_DIR", "~/.deep_ep"])
def test_deepep_v2s_cache_is_checked_inside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str, where: str
) -> None:
    if how == "another user's kernel" and os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    home = tmp_path / "home"
    cache = tmp_path / "jit" / "deep_ep" if where == "EP_JIT_CACHE_DIR" else home / ".deep_ep"
    env = {"HOME": str(home)} | ({"EP_JIT_CACHE_DIR": str(cache)} if "EP" in where else {})
    kernels = cache / "cache" / "kernel.a1b2"
    kernels.mkdir(parents=True)
    for name in ("kernel.cu", "kernel.cubin"):
        (kernels / name).write_text("compiled\n")
    data, _notes, problems = deepep_v2_cache_check(env, monkeypatch)
    assert problems == [] and data["jit_cache_trusted"] is True
    assert data["jit_cache_entries_checked"] == 4

    planted = kernels / "kernel.cubin"
    if how == "a kernel others can write":
        planted.chmod(0o646)
        said = f"others can write {planted} (mode 0646)"
    elif how == "a directory others can write":
        planted = kernels
        planted.chmod(0o777)
        said = f"others can write {planted} (mode 0777)"
    else:
        os.chown(planted, 65534, 65534)
        said = f"{planted} belongs to uid 65534, neither this user nor root"
    data, _notes, problems = deepep_v2_cache_check(env, monkeypatch)
    [(status, detail, hint)] = problems
    assert status.name == "ERROR" and data["jit_cache_trusted"] is False
    assert f"loads its JIT kernels from {cache}, and {said}" in detail, detail
    assert "EP_JIT_CACHE_DIR" in hint and "chmod go-w" in hint


def test_a_cache_too_big_to_walk_is_checked_in_part_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A check that runs before every job does not walk a huge shared cache for minutes: it
    stops after its limit of entries and says how many it looked at."""
    from ep_image.files import trust

    cache = tmp_path / "deep_ep"
    cache.mkdir()
    for n in range(trust.INSIDE_LIMIT):
        (cache / f"k{n:05d}").touch()
    (cache / "zz-planted").touch(mode=0o666)
    (cache / "zz-planted").chmod(0o666)  # past the limit, in name order
    data, notes, problems = deepep_v2_cache_check({"EP_JIT_CACHE_DIR": str(cache)}, monkeypatch)
    assert problems == [] and data["jit_cache_entries_checked"] == trust.INSIDE_LIMIT
    assert [f"JIT cache {cache}: only its first {trust.INSIDE_LIMIT} entries checked"] == [
        n.split(" for ")[0] for n in notes
    ]
    (cache / "k00000").unlink()  # now the walk reaches it
    _data, _notes, problems = deepep_v2_cache_check({"EP_JIT_CACHE_DIR": str(cache)}, monkeypatch)
    assert "others can write" in problems[0][1] and "zz-planted" in problems[0][1]


def _cuda_home_with_nvcc(root: Path) -> Path:
    """A CUDA home whose bin/ holds only an nvcc that prints its release line, and the header
    the prerequisites look for."""
    home = root / "cuda"
    (home / "bin").mkdir(parents=True)
    (home / "include").mkdir()
    (home / "include" / "cuda_runtime.h").write_text("")
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text(
        "#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
        "echo 'Cuda compilation tools, release 13.0, V13.0.88'\n"
    )
    nvcc.chmod(0o755)
    return home


def test_a_cuda_home_without_a_tool_the_jit_runs_is_refused_before_any_buffer(
    check_ep, tmp_path
) -> None:
    """DeepEP v2's JIT runs $CUDA_HOME/bin/cuobjdump on every kernel after nvcc made it: in an
    image whose CUDA home had nvcc and no cuobjdump, prerequisites passed and the first dispatch
    failed with "kernel_runtime.hpp:33): exit_code == 0" (exit 3). A backend declaring both
    tools is refused at prerequisites instead, naming cuobjdump and the fix, with no buffer
    made; it passes once the home holds an executable cuobjdump."""
    home = _cuda_home_with_nvcc(tmp_path)
    bin_dir = home / "bin"
    env = clean_env(CUDA_HOME=str(home))
    args = [*backend("RunsCuobjdumpAfterNvcc"), *SMALL, *QUICK, "--scenarios", "none"]
    run = check_ep(*args, env=env)
    assert run.proc.returncode == 3, run.output
    prereq = run.step("prerequisites")
    assert prereq["status"] == "error", prereq
    assert f"{bin_dir}/cuobjdump" in prereq["detail"], prereq
    assert "nvidia-cuda-cuobjdump" in prereq["hint"] and "CUDA_HOME" in prereq["hint"], prereq
    assert "devel" in prereq["hint"], prereq
    assert prereq["data"]["jit_tools"] == {"nvcc": f"{bin_dir}/nvcc", "cuobjdump": None}
    assert run.statuses()["buffer"] == "not run"
    assert run.proc.stdout.count("result: unusable (exit 3)") == 1

    cuobjdump = bin_dir / "cuobjdump"
    cuobjdump.write_text("#!/bin/sh\nexit 0\n")
    cuobjdump.chmod(0o755)
    passing = check_ep(*args, env=env)
    assert passing.proc.returncode == 0, passing.output
    prereq = passing.step("prerequisites")
    assert prereq["data"]["jit_tools"] == {"nvcc": f"{bin_dir}/nvcc", "cuobjdump": str(cuobjdump)}
    assert "cuobjdump" in prereq["detail"], prereq


def test_the_jit_adapters_declare_what_their_jit_runs_from_the_cuda_home() -> None:
    """ElasticBuffer's JIT runs nvcc, then cuobjdump on every kernel it loads
    (csrc/jit/kernel_runtime.hpp); HybridEPBuffer's runs only $CUDA_HOME/bin/nvcc
    (csrc/hybrid_ep/jit/compiler.cu at e0a5b1d9)."""
    from ep_image.probes._adapters.plugins import ADAPTERS

    elastic, hybrid = ADAPTERS["deep_ep", "ElasticBuffer"], ADAPTERS["deep_ep", "HybridEPBuffer"]
    assert elastic.jit_tools == ("nvcc", "cuobjdump")
    assert hybrid.jit_tools == ("nvcc",)
    assert all(cls.jit_compiles for cls in (elastic, hybrid))


@pytest.mark.parametrize("probe", ["check_ep", "check_train"])
def test_a_torch_that_exits_at_import_is_named_as_its_import_failing(
    tmp_path: Path, probe: str
) -> None:
    """A fake torch first on PYTHONPATH that calls sys.exit(3) when imported. Before: "the
    backend process exited with status 3 during import without a verdict", fixed by "the
    backend ended its process", and the line of the backend process began "probe:". Now the
    import step names torch's import failing, the fix names that torch and PYTHONPATH, and
    every line is the running probe's."""
    shadow = tmp_path / "shadow"
    (shadow / "torch").mkdir(parents=True)
    fake = shadow / "torch" / "__init__.py"
    fake.write_text("import sys\nsys.exit(3)\n")
    env = clean_env(PYTHONPATH=os.pathsep.join([str(shadow), os.environ["PYTHONPATH"]]))
    run = run_probe_in(tmp_path, f"{probe}.py", "--backend", "torch", env=env, timeout=300)
    assert run.proc.returncode == 3, run.output
    step = run.step("import")
    assert step["status"] == "error", step
    assert "importing torch called sys.exit(3)" in step["detail"], step["detail"]
    assert "exited with status" not in step["detail"], step["detail"]
    assert "ended its process" not in step["hint"], step["hint"]
    assert str(shadow / "torch") in step["hint"] and "PYTHONPATH" in step["hint"], step["hint"]
    assert f"{probe}: unexpected ImportError: importing torch" in run.proc.stderr, run.output
    assert "probe: unexpected" not in run.proc.stderr.replace(f"{probe}: unexpected", "")


def test_a_single_rank_check_train_leaves_nothing_in_tmpdir(tmp_path: Path) -> None:
    """check_train on one rank, in an empty TMPDIR: it passes and leaves it empty. Before:
    an empty torchinductor_<user> there, made by inductor's cache when torch._dynamo is first
    imported (torch.optim's step does), in the backend process."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    quick = ["--steps", "2", "--layers", "1", "--tokens", "64"]
    run = run_probe_in(
        tmp_path, "check_train.py", "--backend", "torch", *quick, env=clean_env(TMPDIR=str(tmpdir))
    )
    assert run.proc.returncode == 0, run.output
    assert sorted(p.name for p in tmpdir.iterdir()) == [], "left in TMPDIR"
