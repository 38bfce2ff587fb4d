"""The machine's part of a backend's source build: checked before it starts, keyed for uv's cache.

``preflight`` names a missing nvcc, rdma-core header or driver library before minutes of compile,
``link_stubs`` links that build against the CUDA toolkit's stubs, and ``refresh_cache`` drops
uv's cached build when an input uv does not key on changed. Standard library only. See
docs/backends.md, section "Building the git sources".
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

#: Environment inputs of a CUDA extension build that uv does not key on. NVSHMEM_DIR, LDFLAGS
#: and CPATH are left out: make_venv derives them from the venv (ep_image/nvshmem.py), and the
#: venv's temporary name in them changes every build without changing the result.
KEYED_ENVIRONMENT = (
    "TORCH_CUDA_ARCH_LIST",
    "CUDA_HOME",
    "DISABLE_SM90_FEATURES",
    "DISABLE_AGGRESSIVE_PTX_INSTRS",
    "NVCC_APPEND_FLAGS",
    "NVCC_PREPEND_FLAGS",
)
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
KEY_PREFIX = ".ep-build-key-"
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
# Written by ep_image/source_build.py: a bare -j (unlimited jobs) is bounded by EP_MAKE_JOBS,
# and the declared load bound (MAKEFLAGS' -l) lifted, the job count being the bound here.
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


def build_key(env: dict[str, str], variables: dict[str, str]) -> dict[str, str | None]:
    """The inputs that decide the compiled result, beyond the source and the lock."""
    key: dict[str, str | None] = {name: env.get(name) for name in KEYED_ENVIRONMENT}
    key.update({f"declared:{k}": v for k, v in sorted(variables.items())})
    nvcc = cuda_home(env) / "bin" / "nvcc"
    try:
        out = subprocess.run(
            [str(nvcc), "--version"], capture_output=True, text=True, timeout=60, check=False
        ).stdout
        key["nvcc"] = next((line for line in out.splitlines() if "release" in line), out.strip())
    except OSError:
        key["nvcc"] = None
    return key


def key_digest(key: dict[str, str | None]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def uv_cache_dir(uv: str, env: dict[str, str]) -> Path:
    out = subprocess.run(
        [uv, "cache", "dir"], capture_output=True, text=True, env=env, check=True, timeout=60
    )
    return Path(out.stdout.strip())


class CacheError(RuntimeError):
    """uv's cache could not be cleaned; the message names why and the fix."""


def refresh_cache(
    uv: str,
    distribution: str,
    key: dict[str, str | None],
    env: dict[str, str],
    extra: str = "",
    drop_unkeyed: bool = False,
) -> str:
    """Drop ``distribution``'s cached builds if ``key`` differs from the last build of ``extra``.

    Returns what happened: "first" (no key yet), "unchanged", or "changed" (cache cleaned). The
    key is stored in uv's cache directory, so it lives and dies with the builds it describes (an
    image build's cache mount, a host's ~/.cache/uv), one per extra: DeepEP v1, HybridEP and
    DeepEP v2's variant are all ``deep-ep`` (other commits, other inputs), and one record for
    all would see a change at every switch and rebuild each of them every time.
    ``drop_unkeyed``: also drop the cached builds when there is no key yet (state "first").
    """
    cache = uv_cache_dir(uv, env)
    record = cache / f"{KEY_PREFIX}{distribution}{f'-{extra}' if extra else ''}.json"
    digest = key_digest(key)
    previous = None
    if record.is_file():
        try:
            previous = json.loads(record.read_text()).get("sha256")
        except (OSError, ValueError):
            previous = "unreadable"
    state = "first" if previous is None else ("unchanged" if previous == digest else "changed")
    # A build about to be exported must be one of this key: a cached build with no key (a plain
    # `uv sync`'s) may come from other inputs.
    if state == "changed" or (state == "first" and drop_unkeyed):
        # uv waits for every other uv process on this cache (a `uv run` this runs under never
        # ends first): give up after a minute instead of uv's default five.
        clean = subprocess.run(
            [uv, "cache", "clean", distribution], env={"UV_LOCK_TIMEOUT": "60", **env},
            capture_output=True, text=True, timeout=900, check=False,
        )  # fmt: skip
        if clean.returncode != 0:
            raise CacheError(
                f"the build inputs of {distribution} changed since its last build, and "
                f"`uv cache clean {distribution}` failed ({clean.stderr.strip()[-300:]}): uv "
                "waits for other uv processes that use this cache (e.g. a `uv run` this runs "
                "under) and gives up after UV_LOCK_TIMEOUT. Fix: run it outside `uv run`, or "
                "with its own UV_CACHE_DIR"
            )
    cache.mkdir(parents=True, exist_ok=True)
    temp = record.with_suffix(f".tmp{os.getpid()}")
    temp.write_text(json.dumps({"sha256": digest, "key": key}, indent=2, sort_keys=True) + "\n")
    os.replace(temp, record)
    return state
