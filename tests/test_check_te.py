"""check_te.py where Transformer Engine is absent, and its cuDNN logic on real libraries.

Why these tests: the failure check_te exists for (TE built against one cuDNN, another one
loaded) cannot be staged with TE on a CPU machine, but its ingredients can: this venv holds a
real cuDNN (nvidia-cudnn-cu13) that torch loads on CPU too, so the maps parsing,
``cudnnGetVersion`` and the built-vs-loaded verdict run here on real libraries. So do the two
ways an environment broke TE's import on the H200 image: a second cuDNN release (the base
image's 9.14, as a wheel) first on LD_LIBRARY_PATH, and TE 2.17's own library lookup (its Python
package from PyPI) with CUDNN_PATH set empty. The GPU steps (fused attention, Linear) run on the
GPU runner (gpu-probes.yml).
"""

from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import assert_unwritable_report_is_bad_usage, run_probe_in

from ep_image.probes import _cudnn_libs, _mapped, _te, _versions, check_te
from ep_image.probes._report import Status
from ep_image.probes.check_te import gpu_steps

ROOT = Path(__file__).resolve().parents[1]
PROBE = "ep_image.probes.check_te"
#: The base image's cuDNN release (NGC's libcudnn*.so.9.14.0), older than the lock's 9.24.
OLDER_CUDNN = "nvidia-cudnn-cu13==9.14.0.64"
#: Transformer Engine's Python package at the lock's tag (its import's cuDNN lookup is
#: byte-identical to the image's source build of v2.17).
TE_PYTHON = "transformer-engine==2.17.0"


te_absent = pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is not None, reason="TE is installed here"
)


def run_probe(tmp_path: Path, *args: str, env: dict[str, str] | None = None):
    run = run_probe_in(tmp_path, "check_te.py", *args, env=env or dict(os.environ))
    return run.proc, run.report


def cudnn_wheel_version() -> tuple[int, int, int]:
    try:
        version = metadata.version("nvidia-cudnn-cu13")
    except metadata.PackageNotFoundError:
        pytest.skip("no nvidia-cudnn-cu13 wheel in this environment")
    triplet = _versions.parse_version_triplet(version)
    assert triplet is not None
    return triplet


# ---------------------------------------------------------------------------------------
# The probe end to end: TE missing here
# ---------------------------------------------------------------------------------------


@te_absent
def test_missing_te_exits_4_cleanly(tmp_path: Path) -> None:
    proc, report = run_probe(tmp_path, "--require")
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == list(check_te.STEP_NAMES)
    assert steps["import"]["status"] == "missing"
    assert "transformer_engine is not installed" in steps["import"]["detail"]
    assert "python3 scripts/build_te.py" in steps["import"]["hint"]
    assert all(steps[n]["status"] == "not run" for n in check_te.STEP_NAMES[1:])
    assert report["exit_code"] == 4 and report["result"] == "missing"
    assert "result: missing (exit 4)" in proc.stdout


@te_absent
def test_build_info_path_from_environment(tmp_path: Path) -> None:
    info = tmp_path / "te-build.json"
    info.write_text(json.dumps({"cudnn_version": "9.24.0"}))
    env = dict(os.environ, EP_TE_BUILD_INFO=str(info))
    proc, report = run_probe(tmp_path, env=env)
    assert proc.returncode == 4
    assert f"te-build.json: {info}" in proc.stdout
    assert report["versions"]["te_build_info"] == {"cudnn_version": "9.24.0"}


def test_build_info_path_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Named (flag, then environment), else the one beside the venv, else the image's, else
    none: a host without any is told so, never shown the image's path as if it were there."""
    monkeypatch.delenv("EP_TE_BUILD_INFO", raising=False)
    venv = tmp_path / "venvs" / "deepep_v2"
    venv.mkdir(parents=True)
    if not Path(_te.DEFAULT_TE_BUILD_INFO).exists():
        assert _te.te_build_info_path(None, prefix=str(venv)) is None
    (tmp_path / "venvs" / "te-build.json").write_text("{}")
    assert _te.te_build_info_path(None, prefix=str(venv)) == str(tmp_path / "venvs/te-build.json")
    monkeypatch.setenv("EP_TE_BUILD_INFO", "/env/te-build.json")
    assert _te.te_build_info_path(None) == "/env/te-build.json"
    assert _te.te_build_info_path("/flag.json") == "/flag.json"


@pytest.mark.parametrize(
    ("args", "phrase"),
    [
        (["--seq", "0"], "--seq must be a positive integer"),
        (["--head-dim", "-1"], "--head-dim must be a positive integer"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_usage_exit_2(tmp_path: Path, args: list[str], phrase: str) -> None:
    proc, report = run_probe(tmp_path, *args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("check_te: usage error: ") and phrase in lines[0]
    assert report is None


def test_an_unwritable_report_path_is_bad_usage(tmp_path: Path) -> None:
    assert_unwritable_report_is_bad_usage(tmp_path, "check_te")


# ---------------------------------------------------------------------------------------
# /proc/<pid>/maps and cudnnGetVersion on real libraries
# ---------------------------------------------------------------------------------------

LOADS_CUDNN = textwrap.dedent(
    """
    import sys, torch
    torch.backends.cudnn.version()  # torch dlopens its cuDNN, on CPU too
    for extra in sys.argv[1:]:
        import ctypes
        ctypes.CDLL(extra)
    sys.stdout.write(open("/proc/self/maps").read())
    """
)


def maps_of_a_process_that_loaded_cudnn(*extra_libs: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", LOADS_CUDNN, *extra_libs],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return proc.stdout


def test_maps_parsing_finds_the_real_libraries() -> None:
    import torch

    cudnn_wheel_version()
    maps = maps_of_a_process_that_loaded_cudnn()
    paths = _mapped.parse_maps(maps)
    assert paths and all(p.startswith("/") for p in paths)
    assert len(paths) == len(set(paths))  # one entry per file, in first-seen order
    torch_lib = Path(torch.__file__).parent / "lib"
    assert any(Path(p).parent == torch_lib and "libtorch" in Path(p).name for p in paths)
    cudnn = _mapped.mapped_libraries(r"^libcudnn\.so", maps)
    assert cudnn, "torch loaded no libcudnn"
    assert Path(cudnn[0]).name.startswith("libcudnn.so")
    assert "nvidia/cudnn/lib" in cudnn[0]  # the venv's wheel, not a system copy
    assert Path(cudnn[0]).is_file()


def test_parse_maps_edge_cases() -> None:
    text = "\n".join(
        [
            "7f00-7f01 r-xp 00000000 fe:00 12 /opt/with space/libx.so.1",
            "7f01-7f02 r--p 00001000 fe:00 12 /opt/with space/libx.so.1",
            "7f02-7f03 rw-p 00000000 00:00 0 ",
            "7f03-7f04 rw-p 00000000 00:00 0 [heap]",
            "7f04-7f05 r-xp 00000000 fe:00 13 /tmp/libgone.so (deleted)",
        ]
    )
    assert _mapped.parse_maps(text) == ["/opt/with space/libx.so.1", "/tmp/libgone.so"]


@pytest.mark.parametrize(
    ("raw", "expected"),
    [(92400, (9, 24, 0)), (92000, (9, 20, 0)), (90100, (9, 1, 0)), (8907, (8, 9, 7))],
)
def test_decode_cudnn_version(raw: int, expected: tuple[int, int, int]) -> None:
    assert _cudnn_libs.decode_cudnn_version(raw) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("9.24.0.43", (9, 24, 0)), ("9.20", (9, 20, 0)), ("9", (9, 0, 0)), ("", None), (None, None)],
)
def test_parse_version_triplet(text: str | None, expected: tuple[int, int, int] | None) -> None:
    assert _versions.parse_version_triplet(text) == expected


def test_loaded_cudnn_reports_the_wheel_version_and_path() -> None:
    """cudnnGetVersion through ctypes agrees with the nvidia-cudnn-cu13 wheel's metadata."""
    import torch

    wheel = cudnn_wheel_version()
    torch.backends.cudnn.version()
    loaded = _cudnn_libs.loaded_cudnn()
    assert loaded["path"] and "nvidia/cudnn/lib" in loaded["path"]
    assert _versions.parse_version_triplet(loaded["version"]) == wheel
    assert loaded["raw"] == torch.backends.cudnn.version()


# ---------------------------------------------------------------------------------------
# The built-vs-loaded verdict, fed with the real loaded cuDNN
# ---------------------------------------------------------------------------------------


@pytest.fixture
def real_loaded() -> dict:
    import torch

    cudnn_wheel_version()
    torch.backends.cudnn.version()
    return _cudnn_libs.loaded_cudnn()


def test_cudnn_match_passes(real_loaded: dict) -> None:
    info = {
        "cudnn_version": real_loaded["version"],
        "cudnn_lib": str(Path(real_loaded["path"]).parent),
    }
    status, detail, _, data = check_te.compare_cudnn(info, "/x/te-build.json", real_loaded)
    assert status == Status.PASS, detail
    assert real_loaded["version"] in detail and data["built"] == real_loaded["version"]


def test_cudnn_mismatch_fails_naming_both_and_the_winner(real_loaded: dict) -> None:
    info = {"cudnn_version": "9.20.0", "cudnn_lib": "/opt/venvs/moe/nvidia/cudnn/lib"}
    status, detail, hint, _ = check_te.compare_cudnn(info, "/x/te-build.json", real_loaded)
    assert status == Status.FAIL
    assert "built against cuDNN 9.20.0" in detail
    assert f"cuDNN {real_loaded['version']} is loaded" in detail
    assert real_loaded["path"] in detail
    assert "/opt/venvs/moe/nvidia/cudnn/lib" in hint and "scripts/build_te.py" in hint


def test_cudnn_without_build_record_is_reported_not_failed(real_loaded: dict) -> None:
    status, detail, hint, _ = check_te.compare_cudnn(None, "/nowhere/te-build.json", real_loaded)
    assert status == Status.INFO
    assert "no build record at /nowhere/te-build.json" in detail
    assert "EP_TE_BUILD_INFO" in hint
    skipped = {"skipped": True, "reason": "CPU-only image"}
    status, detail, _, _ = check_te.compare_cudnn(skipped, "/x.json", real_loaded)
    assert status == Status.INFO and "CPU-only image" in detail


def test_no_cudnn_loaded_is_an_error() -> None:
    status, detail, hint, _ = check_te.compare_cudnn(
        {"cudnn_version": "9.24.0"}, "/x.json", {"path": None, "version": None, "all_mapped": []}
    )
    assert status == Status.ERROR and "no libcudnn" in detail and "nvidia-cudnn-cu13" in hint


def test_two_cudnn_copies_mapped_fail(tmp_path: Path, real_loaded: dict) -> None:
    """A second libcudnn.so.9 loaded next to the venv's: the real 'base image copy' hazard."""
    copy = tmp_path / "base-image" / "libcudnn.so.9"
    copy.parent.mkdir()
    shutil.copy2(real_loaded["path"], copy)
    maps = maps_of_a_process_that_loaded_cudnn(str(copy))
    mapped = _mapped.mapped_libraries(r"^libcudnn\.so", maps)
    assert str(copy) in mapped and real_loaded["path"] in mapped
    loaded = {**real_loaded, "all_mapped": mapped}
    info = {"cudnn_version": real_loaded["version"]}
    status, detail, hint, _ = check_te.compare_cudnn(info, "/x.json", loaded)
    assert status == Status.FAIL
    assert "2 different libcudnn.so are mapped" in detail and str(copy) in detail
    assert f"{real_loaded['path']} ({real_loaded['version']})" in detail
    assert "LD_LIBRARY_PATH" in hint and "sub-libraries" in hint


def test_loaded_cudnn_versions_each_mapped_copy(tmp_path: Path) -> None:
    """In a process with two copies mapped, each copy's own cudnnGetVersion is reported."""
    wheel = cudnn_wheel_version()
    import torch

    torch.backends.cudnn.version()
    venv_lib = _cudnn_libs.loaded_cudnn()["path"]
    copy = tmp_path / "libcudnn.so.9"
    shutil.copy2(venv_lib, copy)
    code = (
        "import json, sys, ctypes, torch; torch.backends.cudnn.version(); "
        f"ctypes.CDLL({str(copy)!r}); from ep_image.probes import _cudnn_libs; "
        "print(json.dumps(_cudnn_libs.loaded_cudnn()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    info = json.loads(out)
    assert set(info["versions"]) == {venv_lib, str(copy)}
    expected = ".".join(map(str, wheel))
    assert all(v == expected for v in info["versions"].values())


def test_te_exception_is_unusable_with_the_cudnn_fix() -> None:
    """The error the GPU runner saw with two cuDNN copies loaded (TE 2.17, cuDNN 9.19 + 9.14)."""
    seen = (
        "/te/transformer_engine/common/fused_attn/fused_attn_f16_arbitrary_seqlen.cu:419 in "
        "function operator(): cuDNN Error: CUDNN_BACKEND_TENSOR_DESCRIPTOR cudnnFinalize "
        "failedptrDesc->finalize() cudnn_status: CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED."
    )
    call = gpu_steps._te_call("fused attention backward")
    with pytest.raises(check_te.StepFailed) as caught, call:
        raise RuntimeError(seen)
    assert caught.value.status == Status.ERROR
    assert caught.value.detail.startswith("fused attention backward raised RuntimeError: ")
    assert "python3 scripts/build_te.py" in caught.value.hint
    with pytest.raises(check_te.StepFailed) as caught, gpu_steps._te_call("te.Linear forward"):
        raise ValueError("shape mismatch")
    assert caught.value.hint == ""


# ---------------------------------------------------------------------------------------
# torch itself refusing the loaded cuDNN: the verdict still names built and loaded
# ---------------------------------------------------------------------------------------

STEP_CUDNN = """
import ctypes, json, sys
import torch  # maps the venv's libcudnn.so.9, as any torch process does
from ep_image.probes import check_te
from ep_image.probes._report import StepFailed
errors = []
for path in sys.argv[2:]:  # by path, as Transformer Engine's import loads cuDNN's files
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        errors.append(str(exc))
maps = [line.split(maxsplit=5)[5].strip() for line in open("/proc/self/maps")
        if len(line.split(maxsplit=5)) == 6 and "/libcudnn" in line]
try:
    out = check_te.step_cudnn(sys.argv[1]).to_json()
except StepFailed as exc:
    out = {"status": exc.status.value, "detail": exc.detail, "hint": exc.hint, "data": exc.data}
out["load_errors"] = errors
out["import_verdicts"] = [check_te.import_failure("OSError: " + e, False) for e in errors]
out["mapped_before_step"] = sorted(set(maps))
print(json.dumps(out))
"""


def step_cudnn_in(python: str, record: Path, *load: Path, search_path: str | None = None) -> dict:
    """check_te's cudnn step in a fresh ``python`` that first loaded ``load`` by path, with
    ``search_path`` as its LD_LIBRARY_PATH (unset when None): its JSON, the loader errors
    those loads met and check_te's import verdict on each."""
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    env["PYTHONPATH"] = str(ROOT)
    if search_path is not None:
        env["LD_LIBRARY_PATH"] = search_path
    proc = subprocess.run(
        [python, "-c", STEP_CUDNN, str(record), *map(str, load)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_torch_refusing_the_loaded_cudnn_still_names_built_and_loaded(tmp_path: Path) -> None:
    """A venv holding the lock's torch (compiled against cuDNN 9.24) with an older cuDNN wheel
    in its place: torch refuses it ("compiled against ... but found runtime version ..."), and
    the cudnn step still says TE was built against 9.24, which cuDNN is loaded and from where,
    and the fix (seen on an H200 with 9.19; CPU here, the refusal needs no GPU)."""
    torch_version = metadata.version("torch")
    venv = tmp_path / "venv"
    subprocess.run(["uv", "venv", "-q", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    subprocess.run(["uv", "pip", "install", "-q", "--python", python, f"torch=={torch_version}"],
                   check=True, timeout=900)  # fmt: skip
    subprocess.run(["uv", "pip", "install", "-q", "--python", python, "--no-deps", "--reinstall",
                    OLDER_CUDNN], check=True, timeout=900)  # fmt: skip
    record = tmp_path / "te-build.json"
    record.write_text(json.dumps({"skipped": False, "cudnn_version": "9.24.0"}))
    step = step_cudnn_in(python, record)
    assert step["status"] == "fail", step
    assert "torch refuses the loaded cuDNN" in step["detail"], step["detail"]
    assert "TE was built against cuDNN 9.24.0" in step["detail"]
    assert "cuDNN 9.14.0 from" in step["detail"] and str(venv) in step["detail"]
    assert "scripts/build_te.py" in step["hint"] and "active-cudnn" in step["hint"]


# ---------------------------------------------------------------------------------------
# Two cuDNN releases in one process, and TE's own lookup, on real libraries
# ---------------------------------------------------------------------------------------


def install_target(target: Path, requirement: str) -> Path:
    """``requirement`` alone (no dependencies) under ``target``, as uv installs it; without
    this project's uv settings, which declare build dependencies for its own TE build."""
    cmd = ["uv", "pip", "install", "-q", "--no-config", "--no-deps", "--target", str(target)]
    subprocess.run([*cmd, requirement], check=True, timeout=900)
    return target


@pytest.fixture(scope="module")
def older_cudnn_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another cuDNN release's lib directory (9.14, the base image's), for the whole module."""
    target = install_target(tmp_path_factory.mktemp("older-cudnn"), OLDER_CUDNN)
    lib = target / "nvidia" / "cudnn" / "lib"
    assert (lib / "libcudnn_graph.so.9").is_file()
    return lib


@pytest.fixture(scope="module")
def te_pythonpath(tmp_path_factory: pytest.TempPathFactory) -> str:
    """PYTHONPATH entries under which ``import transformer_engine`` runs TE 2.17's real cuDNN,
    NVRTC and cuRAND lookup on this CPU machine.

    TE's Python package from PyPI, plus the metadata (only) of its core package
    ``transformer-engine-cu13``: TE's import refuses a Python package without a core package
    before it looks for any library. Past the lookup it fails to find its core library, as a
    source build does without a GPU driver: check_te's verdict is "cannot run here".
    """
    te = install_target(tmp_path_factory.mktemp("te-python"), TE_PYTHON)
    core = tmp_path_factory.mktemp("te-core-metadata")
    dist_info = core / "transformer_engine_cu13-2.17.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: transformer_engine_cu13\nVersion: 2.17.0\n"
    )
    (dist_info / "RECORD").write_text(f"{dist_info.name}/METADATA,,\n")
    return os.pathsep.join([str(te), str(core)])


def venv_cudnn_lib() -> Path:
    """This venv's cuDNN wheel directory (the lock's nvidia-cudnn-cu13), real path."""
    cudnn_wheel_version()
    spec = importlib.util.find_spec("nvidia.cudnn")
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations))).resolve() / "lib"


def cudnn_record(tmp_path: Path) -> Path:
    """A te-build.json saying TE was built against this venv's cuDNN, as the image's says."""
    record = tmp_path / "te-build.json"
    built = ".".join(map(str, cudnn_wheel_version()))
    record.write_text(json.dumps({"skipped": False, "cudnn_version": built}))
    return record


def te_env(te_pythonpath: str, record: Path, **extra: str) -> dict[str, str]:
    """The environment for check_te with TE's Python package: no cuDNN variables or loader
    path of the caller's, then ``extra``."""
    drop = {"CUDNN_PATH", "CUDNN_HOME", "LD_LIBRARY_PATH"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join([env.get("PYTHONPATH", ""), te_pythonpath])
    env["EP_TE_BUILD_INFO"] = str(record)
    return {**env, **extra}


@te_absent
@pytest.mark.slow
def test_empty_cudnn_variables_mean_unset(tmp_path: Path, te_pythonpath: str) -> None:
    """``-e CUDNN_PATH= -e CUDNN_HOME=``: TE 2.17's lookup skips only unset variables and
    globbed ``/**/libcudnn.so*`` (through /proc), so check_te never printed anything. Now it
    ends in seconds with the verdict and the cuDNN directories it gets with them unset."""
    record = cudnn_record(tmp_path)
    venv_lib = venv_cudnn_lib()
    runs = {}
    for label, extra in (("unset", {}), ("empty", {"CUDNN_PATH": "", "CUDNN_HOME": ""})):
        (tmp_path / label).mkdir()
        try:
            runs[label] = run_probe_in(
                tmp_path / label, "check_te.py", env=te_env(te_pythonpath, record, **extra),
                timeout=40,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            pytest.fail(f"check_te with the cuDNN variables {label} ran past 40 s")
    for label, run in runs.items():
        assert run.proc.returncode == 5, (label, run.output)
        assert run.statuses() == {"import": "skip", "cudnn": "pass", "fused_attention": "not run",
                                  "linear": "not run"}, (label, run.output)  # fmt: skip
        assert "core lib" in run.step("import")["detail"]
        mapped = {m["dir"] for m in run.step("cudnn")["data"]["libraries"]["mapped"]}
        assert mapped == {str(venv_lib)}, (label, mapped)
    empty, unset = runs["empty"], runs["unset"]
    assert empty.step("import")["data"]["lookup_env_ignored"] == {"CUDNN_HOME": "",
                                                                  "CUDNN_PATH": ""}  # fmt: skip
    assert unset.step("import")["data"]["lookup_env_ignored"] == {}
    assert "CUDNN_HOME='', CUDNN_PATH='': taken as unset" in empty.step("import")["detail"]
    same = ("loaded_path", "libraries")
    assert {k: empty.step("cudnn")["data"][k] for k in same} == {
        k: unset.step("cudnn")["data"][k] for k in same
    }


def test_unbounded_lookup_values() -> None:
    """Empty and / (also spelt // or /.) would make TE search the whole file system; a real
    directory, a relative name that is not /, and unset variables are left to TE."""
    env = {"CUDNN_PATH": "", "CUDNN_HOME": "//", "CUDA_HOME": "/usr/local/cuda",
           "CUDA_PATH": "/.", "NVRTC_HOME": "cuda", "OTHER": ""}  # fmt: skip
    assert check_te.unbounded_lookup_vars(env) == {
        "CUDNN_PATH": "", "CUDNN_HOME": "//", "CUDA_PATH": "/."
    }  # fmt: skip


@pytest.mark.slow
def test_a_process_mixing_two_cudnn_releases_fails_the_cudnn_step(
    tmp_path: Path, older_cudnn_lib: Path
) -> None:
    """The venv's libcudnn_ops.so.9 loaded by path while 9.14 comes first on LD_LIBRARY_PATH:
    its RUNPATH loses to LD_LIBRARY_PATH, so it binds 9.14's libcudnn_graph.so.9 beside the
    venv's libcudnn.so.9. The step lists each directory with its release and names the search
    path as the cause; the same loads with only the venv's cuDNN, or with it first, pass."""
    venv_lib = venv_cudnn_lib()
    record = cudnn_record(tmp_path)
    ops = venv_lib / "libcudnn_ops.so.9"
    wheel = ".".join(map(str, cudnn_wheel_version()))
    step = step_cudnn_in(sys.executable, record, ops, search_path=str(older_cudnn_lib))
    assert step["load_errors"] == []
    assert str(older_cudnn_lib / "libcudnn_graph.so.9") in step["mapped_before_step"]
    assert step["status"] == "fail", step
    detail, hint = step["detail"], step["hint"]
    assert "cuDNN libraries from 2 directories are mapped" in detail, detail
    assert f"{older_cudnn_lib} (9.14.0): libcudnn_graph.so.9" in detail, detail
    assert f"{venv_lib} ({wheel}): " in detail and "libcudnn_ops.so.9" in detail, detail
    assert f"put {venv_lib} first on LD_LIBRARY_PATH" in hint, hint
    assert f"remove {older_cudnn_lib} from LD_LIBRARY_PATH" in hint, hint
    assert "/opt/venvs/active-cudnn" in hint and "build_te" not in hint, hint
    for search_path in (None, f"{venv_lib}:{older_cudnn_lib}"):
        step = step_cudnn_in(sys.executable, record, ops, search_path=search_path)
        assert step["status"] == "pass", (search_path, step)
        dirs = step["data"]["libraries"]["dirs"]
        assert dirs == {str(venv_lib): wheel}, step["data"]["libraries"]


@pytest.mark.slow
def test_another_release_first_on_the_search_path_fails_though_nothing_stayed_mapped(
    tmp_path: Path, older_cudnn_lib: Path
) -> None:
    """The image's case: 9.14 first on LD_LIBRARY_PATH, then the venv's
    libcudnn_heuristic.so.9 loaded by path (TE's import does it) fails with ``undefined
    symbol ..., version libcudnn_graph.so.9`` and the loader rolls the load back, so only the
    venv's cuDNN stays mapped. The cudnn step used to pass; now it fails naming 9.14's
    directory and the search path, and the import error gets the same cause and fix."""
    venv_lib = venv_cudnn_lib()
    record = cudnn_record(tmp_path)
    heuristic = venv_lib / "libcudnn_heuristic.so.9"
    step = step_cudnn_in(sys.executable, record, heuristic, search_path=str(older_cudnn_lib))
    (error,) = step["load_errors"]
    assert "version libcudnn_graph.so.9" in error, error
    assert all(Path(p).parent == venv_lib for p in step["mapped_before_step"]), step
    assert step["status"] == "fail", step
    assert f"{older_cudnn_lib} (9.14.0): " in step["detail"], step["detail"]
    assert "libcudnn_graph.so.9" in step["detail"]
    fix = f"put {venv_lib} first on LD_LIBRARY_PATH"
    assert fix in step["hint"] and str(older_cudnn_lib) in step["hint"], step["hint"]
    ((status, detail, hint),) = step["import_verdicts"]
    assert status == "error", detail  # not "cannot run here": the search path, on any node
    assert f"came from {older_cudnn_lib / 'libcudnn_graph.so.9'} (9.14.0)" in detail, detail
    assert fix in hint and "build_te" not in hint, hint


@te_absent
@pytest.mark.slow
def test_te_import_with_another_cudnn_first_on_the_search_path(
    tmp_path: Path, te_pythonpath: str, older_cudnn_lib: Path
) -> None:
    """check_te end to end, TE's own import doing the loading: with 9.14 first on
    LD_LIBRARY_PATH the cudnn step fails naming it and the fix, after any import outcome. TE
    loads the venv's cuDNN files in directory order; where a sub-library comes before
    libcudnn_graph.so.9 (as on the H200 image), its import fails and names the same cause."""
    env = te_env(te_pythonpath, cudnn_record(tmp_path), LD_LIBRARY_PATH=str(older_cudnn_lib))
    run = run_probe_in(tmp_path, "check_te.py", env=env, timeout=120)
    venv_lib = venv_cudnn_lib()
    fix = f"put {venv_lib} first on LD_LIBRARY_PATH"
    cudnn = run.step("cudnn")
    assert cudnn["status"] == "fail", run.output
    assert f"{older_cudnn_lib} (9.14.0): " in cudnn["detail"] and fix in cudnn["hint"]
    imp = run.step("import")
    assert imp["status"] in ("error", "skip"), run.output
    if imp["status"] == "error":
        assert "version libcudnn_graph.so.9" in imp["detail"], imp
        assert fix in imp["hint"] and "build_te" not in imp["hint"], imp
    else:
        assert "core lib" in imp["detail"], imp
    assert run.proc.returncode == (3 if imp["status"] == "error" else 1), run.output
    assert f"fix: {cudnn['hint']}" in run.proc.stdout
