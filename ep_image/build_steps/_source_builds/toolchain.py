"""The machine's part of a backend's source build: checked before it starts, linked and made.

``preflight`` names a missing nvcc, rdma-core header or driver library before minutes of compile,
``link_stubs`` links that build against the CUDA toolkit's stubs, ``bounded_make`` bounds the
``make -j`` a setup.py runs, ``nccl_link`` links the venv's NCCL. Standard library only. See
docs/backends.md, section "Building the git sources".
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

#: The headers HybridEP's DOCA path includes from ``$RDMA_CORE_HOME/include`` (rdma-core).
RDMA_HEADERS = ("infiniband/verbs.h", "infiniband/mlx5dv.h")
RDMA_FIX = (
    "install rdma-core's development files (Debian/Ubuntu: apt-get install libibverbs-dev "
    "ibverbs-providers; the image's APT_PACKAGES holds them)"
)
#: The driver libraries a backend's link step names, as the linker looks them up: every DeepEP
#: setup.py links ``-lcuda``; HybridEP's multi-node build also ``-l:libnvidia-ml.so.1``. A build
#: machine without a driver links the CUDA toolkit's stubs instead (the file name in the stubs
#: directory beside each); at run time the extension loads the driver's real library.
CUDA_LINK = "libcuda.so"
NVML = "libnvidia-ml.so.1"
STUB_FILES = {CUDA_LINK: "libcuda.so", NVML: "libnvidia-ml.so"}
#: Scratch directory (inside the venv being built) for the stub links; removed after.
SCRATCH = ".ep-source-build"
TRUE = {"1", "true", "t", "yes", "y", "on"}
_SYSTEM_LIB_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
)


def declared_variables(pyproject: dict, distribution: str) -> dict[str, str]:
    """``[tool.uv.extra-build-variables]`` of ``distribution``: what uv sets for its build."""
    table = pyproject.get("tool", {}).get("uv", {}).get("extra-build-variables", {})
    return {str(k): str(v) for k, v in table.get(distribution, {}).items()}


def multinode_doca(variables: dict[str, str]) -> bool:
    """HybridEP's setup.py takes the DOCA/RDMA multi-node path with these variables."""
    on = variables.get("HYBRID_EP_MULTINODE", "0").strip().lower() in TRUE
    nixl = variables.get("USE_NIXL", "0").strip().lower() in TRUE
    return on and not nixl


def driver_links(variables: dict[str, str]) -> tuple[str, ...]:
    """The driver libraries the build links, given its declared variables."""
    return (CUDA_LINK, NVML) if multinode_doca(variables) else (CUDA_LINK,)


def cuda_home(env: dict[str, str]) -> Path:
    return Path(env.get("CUDA_HOME") or "/usr/local/cuda")


def preflight(variables: dict[str, str], env: dict[str, str], nvshmem: bool = False) -> list[str]:
    """What a backend's source build will miss, each with its fix; empty when it can start.

    Every build compiles CUDA kernels and links ``-lcuda``. rdma-core's headers are needed by
    the multi-node build (selected by the declared variables) and by any build against NVSHMEM
    (``nvshmem``): its device headers include ``infiniband/mlx5dv.h`` (seen building DeepEP v1
    against nvidia-nvshmem-cu13 3.4.5). The rest torch's own build reports.
    """
    problems: list[str] = []
    nvcc = cuda_home(env) / "bin" / "nvcc"
    if not nvcc.is_file():
        problems.append(
            f"no nvcc at {nvcc}: the backend compiles CUDA kernels. Fix: set CUDA_HOME to a "
            "CUDA 13 toolkit (a -devel base image has one at /usr/local/cuda)"
        )
    if multinode_doca(variables) or nvshmem:
        home = Path(variables.get("RDMA_CORE_HOME") or env.get("RDMA_CORE_HOME") or "/usr")
        missing = [h for h in RDMA_HEADERS if not (home / "include" / h).is_file()]
        why = (
            "HYBRID_EP_MULTINODE=1 builds the RDMA path"
            if multinode_doca(variables)
            else ("NVSHMEM's device headers are compiled")
        )
        if missing:
            problems.append(
                f"{why} against {home}/include, which lacks {', '.join(missing)}. Fix: {RDMA_FIX}"
            )
    for name in driver_links(variables):
        if on_link_path(name, env) is None and stub_source(name, env) is None:
            problems.append(
                f"the build links {name}, found neither on the linker's path (a driver, "
                f"LIBRARY_PATH) nor as the CUDA toolkit's stub ({cuda_home(env)}/lib64/stubs/"
                f"{STUB_FILES[name]}). Fix: use a CUDA -devel toolkit, which ships the stubs, "
                "or put a directory holding the library on LIBRARY_PATH"
            )
    return problems


def on_link_path(name: str, env: dict[str, str]) -> Path | None:
    """``name`` where the linker finds it by itself: LIBRARY_PATH, the toolkit's lib64 (torch's
    build passes it with -L) or the system's directories."""
    dirs = [d for d in env.get("LIBRARY_PATH", "").split(os.pathsep) if d]
    dirs += [str(cuda_home(env) / "lib64"), *_SYSTEM_LIB_DIRS]
    return next((Path(d) / name for d in dirs if (Path(d) / name).exists()), None)


def stub_source(name: str, env: dict[str, str]) -> Path | None:
    """The CUDA toolkit's stub standing in for ``name`` at link time, if it ships one."""
    home = cuda_home(env)
    candidates = [home / "lib64" / "stubs", *sorted(home.glob("targets/*/lib/stubs"))]
    stub = STUB_FILES[name]
    return next((d / stub for d in candidates if (d / stub).is_file()), None)


def link_stubs(env: dict[str, str], scratch: Path, names: tuple[str, ...]) -> dict[str, str]:
    """LIBRARY_PATH with ``scratch/<name>`` -> the toolkit's stub for each of ``names`` the
    linker would not find by itself; {} when none is needed.

    Only the link step sees it (LIBRARY_PATH, not LD_LIBRARY_PATH or a runpath): at run time the
    extension loads the driver's real library.
    """
    linked = []
    for name in names:
        stub = stub_source(name, env)
        if on_link_path(name, env) is not None or stub is None:
            continue
        scratch.mkdir(parents=True, exist_ok=True)
        link = scratch / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(stub)
        linked.append(name)
    if not linked:
        return {}
    return {
        "LIBRARY_PATH": os.pathsep.join(filter(None, [str(scratch), env.get("LIBRARY_PATH", "")]))
    }


#: ``make`` for a build whose setup.py runs ``make -j`` with no job count (HybridEP's multi-node
#: branch builds NCCL that way): a bare ``-j`` becomes ``-j$EP_MAKE_JOBS -l``. Unbounded, make
#: started over a hundred nvcc and cc1plus processes on a 2-core, 24 GiB build machine and used
#: up its memory. The bare ``-l`` lifts the load bound pyproject.toml declares in MAKEFLAGS for a
#: plain ``uv sync`` (no wrapper there): here the job count is the bound.
MAKE_WRAPPER = """#!/bin/sh
# Written by ep_image/build_steps/_source_builds/toolchain.py: a bare -j (unlimited jobs) is
# bounded by EP_MAKE_JOBS, and the declared load bound (MAKEFLAGS' -l) lifted, the job count
# being the bound here.
n=$#
i=0
while [ "$i" -lt "$n" ]; do
    a=$1
    shift
    if [ "$a" = "-j" ] || [ "$a" = "--jobs" ]; then
        set -- "$@" "-j$EP_MAKE_JOBS" "-l"
    else
        set -- "$@" "$a"
    fi
    i=$((i + 1))
done
exec "$EP_REAL_MAKE" "$@"
"""


def bounded_make(env: dict[str, str], scratch: Path) -> dict[str, str]:
    """PATH with ``scratch/bin/make`` first: the real make, with a bare ``-j`` bounded by
    MAX_JOBS (else the machine's core count); {} where there is no make to wrap."""
    real = shutil.which("make", path=env.get("PATH", os.defpath))
    if real is None:
        return {}
    jobs = env.get("MAX_JOBS", "").strip()
    if not jobs.isdigit() or int(jobs) < 1:
        jobs = str(os.cpu_count() or 1)
    bindir = scratch / "bin"
    bindir.mkdir(parents=True, exist_ok=True)
    wrapper = bindir / "make"
    wrapper.write_text(MAKE_WRAPPER)
    wrapper.chmod(0o755)
    path = os.pathsep.join(filter(None, [str(bindir), env.get("PATH", "")]))
    return {"PATH": path, "EP_REAL_MAKE": real, "EP_MAKE_JOBS": jobs}


class LinkError(RuntimeError):
    """A library the build links is not in the venv; the message names the fix."""


def nccl_link(venv_site: Path, env: dict[str, str]) -> dict[str, str]:
    """LIBRARY_PATH with the venv's ``nvidia/nccl/lib`` first, for a build that links
    ``-l:libnccl.so.2`` without saying where (the same NCCL the venv loads at run time, where
    torch has already loaded it by its soname)."""
    lib = venv_site / "nvidia" / "nccl" / "lib"
    if not (lib / "libnccl.so.2").exists():
        raise LinkError(
            f"{lib}/libnccl.so.2 is missing, which the backend's build links. Fix: keep "
            "nvidia-nccl-cu13 in the venv (not in VENV_SKIP_PACKAGES / --no-install-package)"
        )
    return {"LIBRARY_PATH": os.pathsep.join(filter(None, [str(lib), env.get("LIBRARY_PATH", "")]))}
