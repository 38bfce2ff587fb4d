"""check_env.py on this machine's real environment, and where things are absent.

Why these tests: the manifest is what a bug report and an image record start from, so what it
says must be what the environment holds. Here it is cross-checked against independent sources
(package metadata, torch itself, the files on disk), and run where nothing optional exists to
prove it reports nulls instead of failing.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import assert_unwritable_report_is_bad_usage, run_probe_in
from fake_installs import fake_deep_ep

ROOT = Path(__file__).resolve().parents[1]
PROBE = "ep_image.probes.check_env"


TOP_KEYS = {
    "schema_version", "probe", "python", "torch", "torch_error", "cuda_toolkit",
    "transformer_engine", "cudnn", "nccl", "nvshmem", "ep_backend", "gpu", "environment",
}  # fmt: skip


def run_env(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None, python: list[str] | None = None
) -> tuple[subprocess.CompletedProcess[str], dict | None]:
    run = run_probe_in(tmp_path, "check_env.py", *args, python=python, env=env or dict(os.environ))
    return run.proc, run.report


def version_or_none(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    tmp = tmp_path_factory.mktemp("env")
    info = tmp / "te-build.json"
    info.write_text(json.dumps({"cudnn_version": "9.24.0", "te_version": "2.17.0"}))
    env = dict(os.environ, EP_BACKEND="deepep_v2", EP_TE_BUILD_INFO=str(info))
    proc, data = run_env(tmp, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert data is not None
    return proc.stdout, data


def test_manifest_shape(manifest: tuple[str, dict]) -> None:
    _, m = manifest
    assert set(m) == TOP_KEYS
    assert m["probe"] == "check_env" and m["schema_version"] == 1
    # Which venv it ran in (this test's runner has no make_venv record) and what came from
    # outside it: the probe itself imports nothing from elsewhere.
    assert m["environment"]["prefix"] == sys.prefix and m["environment"]["record"] is None
    assert m["environment"]["loaded_outside_venv"]["modules"] == []


def test_python_and_torch_match_this_interpreter(manifest: tuple[str, dict]) -> None:
    import torch

    _, m = manifest
    assert m["python"]["executable"] == sys.executable
    assert m["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    assert m["torch"]["version"] == torch.__version__
    assert m["torch"]["version"].split("+")[0] == metadata.version("torch").split("+")[0]
    assert m["torch"]["cuda"] == torch.version.cuda
    assert m["torch"]["cuda_available"] == torch.cuda.is_available()
    assert m["torch_error"] is None


def test_nccl_cudnn_nvshmem_versions_agree_with_their_wheels(manifest: tuple[str, dict]) -> None:
    _, m = manifest
    nccl = version_or_none("nvidia-nccl-cu13")
    if nccl:
        assert m["nccl"]["dist"] == {"distribution": "nvidia-nccl-cu13", "version": nccl}
        # What torch says it runs equals the wheel it loaded, and the path is that wheel's.
        assert m["nccl"]["torch_reports"] == ".".join(nccl.split(".")[:3])
    cudnn = version_or_none("nvidia-cudnn-cu13")
    if cudnn:
        assert m["cudnn"]["dist"]["version"] == cudnn
        assert m["cudnn"]["loaded"] == ".".join(cudnn.split(".")[:3])
        assert m["cudnn"]["torch_reports"] == m["cudnn"]["loaded"]
        assert "nvidia/cudnn/lib/libcudnn.so" in m["cudnn"]["loaded_path"]
        assert Path(m["cudnn"]["loaded_path"]).is_file()
    nvshmem = version_or_none("nvidia-nvshmem-cu13")
    expected = {"distribution": "nvidia-nvshmem-cu13", "version": nvshmem} if nvshmem else None
    assert m["nvshmem"]["dist"] == expected


def test_te_build_info_and_backend_env(manifest: tuple[str, dict]) -> None:
    stdout, m = manifest
    assert m["cudnn"]["built"] == "9.24.0"
    assert m["transformer_engine"]["build_info"]["te_version"] == "2.17.0"
    assert m["ep_backend"]["EP_BACKEND"] == "deepep_v2"
    if version_or_none("transformer-engine") is None:
        assert m["transformer_engine"]["dist"] is None
        assert "transformer engine  null" in stdout
    assert "EP_BACKEND          deepep_v2" in stdout


def test_cuda_toolkit_and_gpu_are_reported_or_null(manifest: tuple[str, dict]) -> None:
    import shutil

    _, m = manifest
    nvcc = shutil.which("nvcc")
    if nvcc:
        assert m["cuda_toolkit"]["nvcc"] is not None
        assert m["cuda_toolkit"]["nvcc_version"].count(".") >= 1
    if shutil.which("nvidia-smi") is None:
        assert m["gpu"]["nvidia_smi"] is None and m["gpu"]["driver"] is None
    else:
        assert m["gpu"]["driver"]


def test_no_deep_ep_here_is_null(manifest: tuple[str, dict]) -> None:
    import importlib.util

    _, m = manifest
    if importlib.util.find_spec("deep_ep") is None:
        ep = m["ep_backend"]
        assert ep["detected"] is None and ep["version"] is None and ep["commit"] is None
        assert "no module named deep_ep" in ep["how"]


def test_git_built_backend_reports_its_commit(tmp_path: Path) -> None:
    site = fake_deep_ep(
        tmp_path / "site", "deep_ep", "1.2.1+e0a5b1d", ["buffer.py", "hybrid_ep_buffer.py"], ""
    )
    (site / "deep_ep-1.2.1+e0a5b1d.dist-info" / "direct_url.json").write_text(
        json.dumps(
            {
                "url": "https://github.com/deepseek-ai/DeepEP",
                "vcs_info": {"vcs": "git", "commit_id": "e0a5b1d9848ab3e7b4a67842bf06f067bfac67f8"},
            }
        )
    )
    proc, m = run_env(tmp_path, env=dict(os.environ, PYTHONPATH=str(site), EP_BACKEND="hybridep"))
    assert proc.returncode == 0, proc.stderr
    ep = m["ep_backend"]
    assert ep["detected"] == "hybridep"
    assert ep["version"] == "1.2.1+e0a5b1d"
    assert ep["commit"] == "e0a5b1d9848ab3e7b4a67842bf06f067bfac67f8"
    assert (
        "hybridep = deep_ep 1.2.1+e0a5b1d @ e0a5b1d9848ab3e7b4a67842bf06f067bfac67f8" in proc.stdout
    )
    assert ep["upstream"] == "https://github.com/deepseek-ai/DeepEP"
    assert ep["commit_source"] == "git build: direct_url.json"


@pytest.mark.parametrize(
    ("dist", "version", "upstream", "why"),
    [
        ("sgl-deep-ep", "0.1.2.post1", "https://github.com/sgl-project/DeepEP", "SGLang's binary"),
        ("tokenspeed-deepep", "1.2.1.post20251110", None, "names neither a source repository"),
        ("deep_ep", "2.0.0+local", None, "without git metadata"),
    ],
)
def test_a_wheel_says_plainly_that_its_commit_is_unknown(
    tmp_path: Path, dist: str, version: str, upstream: str | None, why: str
) -> None:
    """Wheels record no commit: the manifest says "unknown" and why, never a bare null."""
    site = fake_deep_ep(tmp_path / "site", dist, version, ["buffers/elastic.py"], "")
    proc, m = run_env(tmp_path, env=dict(os.environ, PYTHONPATH=str(site)))
    assert proc.returncode == 0, proc.stderr
    ep = m["ep_backend"]
    assert ep["commit"] is None
    assert ep["commit_source"].startswith("unknown: ") and why in ep["commit_source"]
    assert ep["upstream"] == upstream
    assert "(commit unknown: " in proc.stdout


def test_nothing_optional_present_still_exits_0(tmp_path: Path) -> None:
    """An interpreter without site-packages (no torch, no wheels) and no tools on PATH."""
    env = {"PATH": "/nonexistent", "HOME": str(tmp_path)}
    proc, m = run_env(tmp_path, env=env, python=[sys.executable, "-S", "-s"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert m["torch"] is None and m["torch_error"] is None
    assert m["cudnn"]["loaded"] is None and m["cudnn"]["dist"] is None
    assert m["nccl"]["dist"] is None and m["nvshmem"]["dist"] is None
    assert m["gpu"]["nvidia_smi"] is None
    assert m["ep_backend"]["detected"] is None
    assert "torch               null CUDA null" in proc.stdout
    assert "Traceback" not in proc.stderr


def test_an_unwritable_report_path_is_bad_usage(tmp_path: Path) -> None:
    assert_unwritable_report_is_bad_usage(tmp_path, "check_env")


def test_bad_usage_exit_2(tmp_path: Path) -> None:
    proc, m = run_env(tmp_path, "--nope")
    assert proc.returncode == 2 and m is None
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("check_env: usage error: unrecognized arguments")


def fake_cuda_home(root: Path) -> tuple[Path, Path]:
    """A CUDA home at ``root/cuda-13.0`` whose nvcc answers --version and -dryrun as nvcc does,
    and a wrapper ``root/bin/nvcc`` that runs it (as /usr/local/bin/nvcc does on some hosts)."""
    home = root / "cuda-13.0"
    (home / "include").mkdir(parents=True)
    (home / "include" / "cuda_runtime.h").write_text("/* cuda runtime */\n")
    (home / "bin").mkdir()
    real = home / "bin" / "nvcc"
    real.write_text(
        "#!/bin/sh\n"
        'case "$*" in\n'
        '  *--version*) echo "Cuda compilation tools, release 13.0, V13.0.88" ;;\n'
        f'  *-dryrun*) echo "#$ _HERE_={home}/bin" >&2; echo "#$ TOP={home}/bin/.." >&2 ;;\n'
        "esac\n"
    )
    wrapper = root / "bin" / "nvcc"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec {real} "$@"\n')
    for exe in (real, wrapper):
        exe.chmod(0o755)
    return home, wrapper


def test_cuda_home_behind_an_nvcc_wrapper_is_the_toolkit_not_the_wrappers_parent(
    tmp_path: Path,
) -> None:
    """nvcc on PATH as a script in <dir>/bin that runs the toolkit's nvcc: the CUDA home is the
    toolkit's (the one holding include/cuda_runtime.h), not <dir>."""
    home, wrapper = fake_cuda_home(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH")}
    env["PATH"] = f"{wrapper.parent}:/usr/bin:/bin"
    proc, m = run_env(tmp_path, env=env)
    assert proc.returncode == 0 and m is not None, proc.stdout + proc.stderr
    toolkit = m["cuda_toolkit"]
    assert toolkit["home"] == str(home), toolkit
    assert toolkit["nvcc_version"] == "13.0.88"
    assert "nvcc on PATH" in toolkit["found_by"] and str(wrapper) in toolkit["found_by"]
    assert f"cuda toolkit        {home} nvcc 13.0.88" in proc.stdout
    # CUDA_HOME still wins.
    proc, m = run_env(tmp_path, env={**env, "CUDA_HOME": str(tmp_path / "other")})
    assert m is not None and m["cuda_toolkit"]["home"] == str(tmp_path / "other")


def test_no_te_build_json_is_said_so_not_the_images_path(tmp_path: Path) -> None:
    """On a host without the image's /opt/venvs/te-build.json and nothing named: the manifest
    says there is none instead of naming a path that is not there."""
    env = {k: v for k, v in os.environ.items() if k != "EP_TE_BUILD_INFO"}
    proc, m = run_env(tmp_path, env=env)
    assert m is not None, proc.stdout + proc.stderr
    if (
        Path("/opt/venvs/te-build.json").exists()
        or (Path(sys.prefix).parent / "te-build.json").exists()
    ):
        pytest.skip("this machine has a te-build.json where the probe looks")
    assert m["transformer_engine"]["build_info_path"] is None
    assert "from /opt/venvs/te-build.json" not in proc.stdout
    assert "cudnn built (TE)    null, no te-build.json (looked at " in proc.stdout
