"""What Transformer Engine compiles in: the build venv, its build tools, and the variables TE reads.

Why a module of its own: TE's build has no isolation (its torch extension must compile against
the venv's torch), so the venv is the build environment. It is made from the lock (the ``moe``
extra without TE, as the backend venvs are made) or given, and every cuDNN lookup of TE's
setup.py and CMake is pointed at that venv's cuDNN: a TE built against another cuDNN fails in
fused-attention backward.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

from ep_image.build_steps import _lock_sync
from ep_image.build_steps._te_wheels import TE_DISTRIBUTION
from ep_image.build_steps._uv.run import BuildError, tail
from ep_image.build_steps._venv.cudnn import Cudnn, dist_version
from ep_image.build_steps._venv.layout import site_packages
from ep_image.build_steps.build_te.source import BuildTeError

# What TE's setup.py / CMake import or run besides torch, which the venv already holds.
# TE's own pyproject lists them as build requirements; with no build isolation they must be in
# the venv. Pinned here (build tools only, nothing TE links at run time); `--install-build-deps`
# installs exactly these with uv.
BUILD_REQUIREMENTS: tuple[str, ...] = (
    "cmake==3.31.10",
    "ninja==1.13.0",
    "pybind11==2.13.6",
    "wheel==0.45.1",
)


# --- the build venv -----------------------------------------------------------------------------


def make_build_venv(uv: str, venv: Path, project: Path) -> Path:
    """The environment TE compiles against: the lock's ``moe`` extra without TE itself, made by
    the same steps as the backend venvs (no bytecode: it lives only for this build)."""
    try:
        _lock_sync.check_lock(uv, project)
        python = os.environ.get("UV_PYTHON")
        _lock_sync.create_venv(uv, venv, python, project, relocatable=False)
        env = {**_lock_sync.sync_environment(venv), "UV_COMPILE_BYTECODE": "0"}
        _lock_sync.sync(uv, venv, project, ["moe"], [TE_DISTRIBUTION], env=env)
    except BuildError as exc:
        raise BuildTeError(
            f"making the build venv from {project / 'uv.lock'} failed (output above). Fix what "
            f"uv's error names; it ends:\n{tail(str(exc))}"
        ) from None
    return venv


def torch_version(venv: Path) -> str | None:
    """The venv's torch version (from dist-info: no import, so no CUDA libraries needed)."""
    return dist_version(site_packages(venv), "torch")


def missing_build_requirements(venv: Path) -> list[str]:
    """BUILD_REQUIREMENTS not installed in the venv (any version counts as installed)."""
    site = site_packages(venv)
    return [req for req in BUILD_REQUIREMENTS if dist_version(site, req.split("==")[0]) is None]


def install_build_requirements(uv: str, venv: Path) -> None:
    """Install BUILD_REQUIREMENTS into the venv (pinned, from the registry)."""
    cmd = [uv, "pip", "install", "--python", str(venv / "bin" / "python"), *BUILD_REQUIREMENTS]
    print("build_te: " + shlex.join(cmd), flush=True)
    subprocess.run(cmd, check=True)


# --- the compiler and the variables -------------------------------------------------------------


def nvcc_binary(env: Mapping[str, str]) -> Path:
    """nvcc the way TE finds it: $CUDA_HOME/bin/nvcc, else PATH, else /usr/local/cuda."""
    if env.get("CUDA_HOME"):
        return Path(env["CUDA_HOME"]) / "bin" / "nvcc"
    found = shutil.which("nvcc", path=env.get("PATH"))
    return Path(found) if found else Path("/usr/local/cuda/bin/nvcc")


def cuda_version(env: Mapping[str, str]) -> str:
    """CUDA release from `nvcc --version` (what TE's build_tools.utils.cuda_version reads)."""
    nvcc = nvcc_binary(env)
    if not nvcc.is_file():
        raise BuildTeError(
            f"nvcc not found at {nvcc}: TE compiles CUDA code. Fix: build in a CUDA devel "
            "image or set CUDA_HOME to a CUDA 13 toolkit."
        )
    out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=True)
    match = re.search(r"release\s+([\d.]+)", out.stdout)
    return match.group(1) if match else "unknown"


def nvte_archs(arch_list: str) -> str:
    """'9.0;10.0' (TORCH_CUDA_ARCH_LIST style) -> '90;100' (NVTE_CUDA_ARCHS / CMake style)."""
    out = []
    for arch in re.split(r"[;\s]+", arch_list.strip()):
        match = re.fullmatch(r"(\d+)\.(\d)([af]?)", arch)
        if match is None:
            raise BuildTeError(
                f"bad architecture {arch!r} in --arch-list {arch_list!r}. "
                'Fix: use compute capabilities like "9.0;10.0" (Hopper; Blackwell).'
            )
        out.append("".join(match.groups()))
    return ";".join(out)


def build_env(
    base: Mapping[str, str], venv: Path, cudnn: Cudnn, arch_list: str, jobs: int, threads: int
) -> dict[str, str]:
    """The variables TE's setup.py/CMake read, pointing every cuDNN lookup at the venv."""

    def prepend(name: str, *values: Path) -> str:
        return os.pathsep.join([*map(str, values), *filter(None, [base.get(name)])])

    # TE's util/logging.h includes nccl.h even with NCCL EP off: the lock's NCCL headers, the
    # NCCL the venv loads at run time.
    nccl = site_packages(venv) / "nvidia" / "nccl" / "include"
    includes = [cudnn.include, *([nccl] if (nccl / "nccl.h").is_file() else [])]
    return {
        # cudnn-frontend's cuDNN.cmake searches these before the CUDA toolkit and system paths.
        "CUDNN_PATH": str(cudnn.root),
        "CUDNN_HOME": str(cudnn.root),
        "CUDNN_INCLUDE_PATH": str(cudnn.include),
        "CUDNN_LIBRARY_PATH": str(cudnn.lib),
        # Compiler/linker search order: the venv's cuDNN ahead of any /usr/include copy.
        "CPATH": prepend("CPATH", *includes),
        "LIBRARY_PATH": prepend("LIBRARY_PATH", cudnn.lib),
        "LD_LIBRARY_PATH": prepend("LD_LIBRARY_PATH", cudnn.lib),
        # cmake and ninja from the venv (TE's found_ninja() looks on PATH).
        "PATH": prepend("PATH", venv / "bin"),
        "VIRTUAL_ENV": str(venv),
        "NVTE_FRAMEWORK": "pytorch",
        # check_source has checked the submodules TE's CMake reads and linked in the frontend;
        # TE's own git check would refuse that link and a snapshot without .gitmodules state.
        "NVTE_SKIP_SUBMODULE_CHECKS_DURING_BUILD": "1",
        "NVTE_CUDA_ARCHS": nvte_archs(arch_list),
        "TORCH_CUDA_ARCH_LIST": arch_list,
        "MAX_JOBS": str(jobs),
        "NVTE_BUILD_THREADS_PER_JOB": str(threads),
    }


def build_command(uv: str, venv: Path, source: Path, out: Path) -> list[str]:
    """`uv build` with the venv's interpreter and no isolation (TE's documented uv recipe)."""
    return [
        uv,
        "build",
        "--wheel",
        "--no-build-isolation",
        "--python",
        str(venv / "bin" / "python"),
        "--out-dir",
        str(out),
        str(source),
    ]
