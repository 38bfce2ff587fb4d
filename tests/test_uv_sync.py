"""A real `uv sync` of backend extras into throwaway venvs, then an install-level check.

What this proves: the lock installs on Linux x86_64 and each venv holds exactly its backend's
`deep_ep` with every shared library its extension needs (ep_image/build_steps/check_installed.py).
What it does NOT prove: that the backend works. deep_ep needs a GPU driver even to import;
ep_image/probes/check_ep/ on a GPU is what proves a backend works.

The first run downloads ~5 GB (torch and the CUDA 13 libraries) into uv's cache; later runs
hardlink from that cache in seconds (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from pathlib import Path

import pytest

from ep_image import backends

ROOT = Path(__file__).resolve().parents[1]
#: Backends installed from a prebuilt wheel. The source-built ones need their pinned git commit
#: and a CUDA toolchain; tests/test_make_venv.py builds stand-ins for them from a git mirror.
WHEEL_BACKENDS = [s.name for s in backends.SPECS if not s.builds_from_source]
JIT_CACHE = "NCCL_EP_JIT_CACHE_DIR"


def sync(venv: Path, *extras: str, skip: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    args = ["uv", "sync", "--frozen", "--no-install-package", "transformer-engine"]
    for package in skip:
        args += ["--no-install-package", package]
    for extra in extras:
        args += ["--extra", extra]
    env = {**os.environ, "UV_PROJECT_ENVIRONMENT": str(venv)}
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)


def check_installed(venv: Path, backend: str, report: Path) -> subprocess.CompletedProcess[str]:
    args = [
        sys.executable,
        "-m",
        "ep_image.build_steps.check_installed",
        "--venv",
        str(venv),
        "--backend",
        backend,
        "--json",
        str(report),
    ]
    return subprocess.run(args, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("backend", WHEEL_BACKENDS)
def test_sync_backend_extra_installs_its_backend(backend: str, tmp_path: Path) -> None:
    venv = tmp_path / backend
    result = sync(venv, backend)
    assert result.returncode == 0, result.stderr
    report_path = tmp_path / "installed.json"
    checked = check_installed(venv, backend, report_path)
    print(checked.stdout)  # shows "installed, not yet proven to work" in the test log
    assert checked.returncode == 0, checked.stdout + checked.stderr
    report = json.loads(report_path.read_text())
    assert report["status"] == "installed, not yet proven to work"
    assert len(report["distributions"]) == 1
    # Every library the extensions need resolves, libcuda.so.1 (the driver's) aside. A backend
    # of several native libraries (NCCL EP: its kernels' library and Cython helpers) has some
    # that do not link the driver; the backend's own kernels do.
    extensions = report["extensions"].values()
    for libs in extensions:
        assert all(where is not None for where in libs.values())
        assert libs.get("libcuda.so.1", "GPU driver (host, at run time)") == (
            "GPU driver (host, at run time)"
        )
    assert any("libcuda.so.1" in libs for libs in extensions), report["extensions"]
    # Every venv of the project gives NCCL EP's JIT a cache of this user's own (the project's
    # .pth, venv_startup/): its library's default, /tmp/nccl_ep/jit, is anyone's to plant in.
    show = "import os; print(os.environ['NCCL_EP_JIT_CACHE_DIR'])"
    unset = (JIT_CACHE, "XDG_CACHE_HOME")
    cache = subprocess.run(
        [str(venv / "bin" / "python"), "-c", show], capture_output=True, text=True, timeout=60,
        env={k: v for k, v in os.environ.items() if k not in unset},
    )  # fmt: skip
    assert cache.returncode == 0, cache.stderr
    assert cache.stdout.strip() == str(Path(pwd.getpwuid(os.getuid()).pw_dir, ".cache/nccl_ep/jit"))


def run_probe(venv: Path, *args: str) -> subprocess.CompletedProcess[str]:
    python = str(venv / "bin" / "python")
    cmd = [python, "-m", "ep_image.probes.check_ep", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_probe_runs_inside_a_backend_venv(tmp_path: Path) -> None:
    """The probe must work with only what a backend venv holds, and needs nothing more: not
    pytest, and not even the numpy the venvs hold for deep_ep.Buffer (left out here)."""
    venv = tmp_path / "deepep_v2"
    assert sync(venv, "deepep_v2", skip=("numpy",)).returncode == 0
    assert not list(venv.glob("lib/python3.*/site-packages/numpy")), "numpy crept in"
    report = tmp_path / "torch.json"
    torch_run = run_probe(
        venv, "--backend", "torch", "--nproc-per-node", "2", "--json", str(report)
    )
    assert torch_run.returncode == 0, torch_run.stdout + torch_run.stderr
    assert json.loads(report.read_text())["world_size"] == 2
    # auto finds DeepEP v2 here; without a GPU that is "cannot run here", never a crash.
    auto = run_probe(venv, "--json", str(tmp_path / "auto.json"))
    assert auto.returncode == 5, auto.stdout + auto.stderr
    assert "deepep_v2" in auto.stdout
    assert "--backend torch" in auto.stdout
    for run in (torch_run, auto):  # torch warns on import without numpy; the probes silence it
        assert "Failed to initialize NumPy" not in run.stderr, run.stderr


@pytest.mark.slow
def test_sync_moe_installs_default_backend_and_cudnn(tmp_path: Path) -> None:
    """moe without TE's git build (the image builds TE once: ep_image/build_steps/build_te.py)."""
    venv = tmp_path / "moe"
    result = sync(venv, "moe")
    assert result.returncode == 0, result.stderr
    checked = check_installed(venv, "deepep_v2", tmp_path / "r.json")
    assert checked.returncode == 0, checked.stdout
    site = next(venv.glob("lib/python3.*/site-packages"))
    assert (site / "nvidia" / "cudnn" / "include" / "cudnn_version.h").is_file()
    assert (site / "nvidia" / "nvshmem" / "lib" / "libnvshmem_host.so.3").is_file()


def test_check_installed_flags_the_wrong_backend(tmp_path: Path) -> None:
    """The install check fails, naming the fix, on a venv without the asked-for backend."""
    venv = tmp_path / "empty"
    subprocess.run(["uv", "venv", "-q", str(venv)], check=True, timeout=120)
    checked = check_installed(venv, "hybridep", tmp_path / "r.json")
    assert checked.returncode == 1
    assert "uv sync --extra hybridep" in checked.stdout
    unknown = subprocess.run(
        [
            sys.executable,
            "-m",
            "ep_image.build_steps.check_installed",
            "--venv",
            str(venv),
            "--backend",
            "v3",
        ],
        capture_output=True,
        text=True,
    )
    assert unknown.returncode == 2
    assert "deepep_v1, deepep_v2, hybridep" in unknown.stderr
