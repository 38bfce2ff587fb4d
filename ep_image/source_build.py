"""The machine's part of a backend's source build: checked before it starts, keyed for uv's cache.

Why: HybridEP's multi-node build (``HYBRID_EP_MULTINODE=1`` in pyproject.toml's
``[tool.uv.extra-build-variables]``, DOCA path) compiles against rdma-core's headers under
``RDMA_CORE_HOME`` and links ``-l:libnvidia-ml.so.1``, which a build machine without a driver
lacks; either fails many minutes into the compile with a linker or preprocessor line. So
``preflight`` names the fix first, and ``nvml_stub`` puts the CUDA toolkit's NVML stub on the
link path of that one build (the driver's real library is loaded at run time).

uv keys its build cache on the source and the declared build variables, not on the environment
(tests/test_build_variables.py shows a changed ``TORCH_CUDA_ARCH_LIST`` silently reusing the old
wheel). ``refresh_cache`` keys the build on those inputs, as Megatron keys its wheel cache: when
they changed since the last build that used this uv cache, it drops the package's cached builds.
Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import os
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
NVML = "libnvidia-ml.so.1"
KEY_PREFIX = ".ep-build-key-"
#: Scratch directory (inside the venv being built) for the NVML stub link; removed after.
SCRATCH = ".ep-source-build"
TRUE = {"1", "true", "t", "yes", "y", "on"}


def declared_variables(pyproject: dict, distribution: str) -> dict[str, str]:
    """``[tool.uv.extra-build-variables]`` of ``distribution``: what uv sets for its build."""
    table = pyproject.get("tool", {}).get("uv", {}).get("extra-build-variables", {})
    return {str(k): str(v) for k, v in table.get(distribution, {}).items()}


def multinode_doca(variables: dict[str, str]) -> bool:
    """HybridEP's setup.py takes the DOCA/RDMA multi-node path with these variables."""
    on = variables.get("HYBRID_EP_MULTINODE", "0").strip().lower() in TRUE
    nixl = variables.get("USE_NIXL", "0").strip().lower() in TRUE
    return on and not nixl


def cuda_home(env: dict[str, str]) -> Path:
    return Path(env.get("CUDA_HOME") or "/usr/local/cuda")


def preflight(variables: dict[str, str], env: dict[str, str]) -> list[str]:
    """What HybridEP's multi-node build will miss, each with its fix; empty when it can start
    (or when the declared variables do not select that build: then torch's own build says what
    is missing)."""
    problems: list[str] = []
    if not multinode_doca(variables):
        return problems
    nvcc = cuda_home(env) / "bin" / "nvcc"
    if not nvcc.is_file():
        problems.append(
            f"no nvcc at {nvcc}: the backend compiles CUDA kernels (and NCCL's DOCA objects). "
            "Fix: set CUDA_HOME to a CUDA 13 toolkit (a -devel base image has one at "
            "/usr/local/cuda)"
        )
    home = Path(variables.get("RDMA_CORE_HOME") or env.get("RDMA_CORE_HOME") or "/usr")
    missing = [h for h in RDMA_HEADERS if not (home / "include" / h).is_file()]
    if missing:
        problems.append(
            f"HYBRID_EP_MULTINODE=1 builds the RDMA path against {home}/include, which lacks "
            f"{', '.join(missing)}. Fix: {RDMA_FIX}"
        )
    if nvml_on_link_path(env) is None and nvml_stub_source(env) is None:
        problems.append(
            f"the multi-node build links {NVML}, found neither on the loader's path (a "
            f"driver) nor as the CUDA toolkit's stub ({cuda_home(env)}/lib64/stubs/"
            "libnvidia-ml.so). Fix: use a CUDA -devel toolkit, which ships the stub"
        )
    return problems


def nvml_on_link_path(env: dict[str, str]) -> Path | None:
    """A ``libnvidia-ml.so.1`` the linker finds by itself (LIBRARY_PATH or the system's)."""
    dirs = [d for d in env.get("LIBRARY_PATH", "").split(os.pathsep) if d]
    dirs += ["/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib"]
    return next((Path(d) / NVML for d in dirs if (Path(d) / NVML).exists()), None)


def nvml_stub_source(env: dict[str, str]) -> Path | None:
    home = cuda_home(env)
    candidates = [home / "lib64" / "stubs", *sorted(home.glob("targets/*/lib/stubs"))]
    return next(
        (d / "libnvidia-ml.so" for d in candidates if (d / "libnvidia-ml.so").is_file()), None
    )


def nvml_stub(env: dict[str, str], scratch: Path) -> dict[str, str]:
    """LIBRARY_PATH with ``scratch/libnvidia-ml.so.1`` -> the toolkit's stub, when needed.

    Only the link step sees it (LIBRARY_PATH, not LD_LIBRARY_PATH or a runpath): at run time the
    extension loads the driver's real NVML.
    """
    if nvml_on_link_path(env) is not None:
        return {}
    stub = nvml_stub_source(env)
    if stub is None:
        return {}
    scratch.mkdir(parents=True, exist_ok=True)
    link = scratch / NVML
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(stub)
    path = os.pathsep.join(filter(None, [str(scratch), env.get("LIBRARY_PATH", "")]))
    return {"LIBRARY_PATH": path}


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


def refresh_cache(
    uv: str, distribution: str, key: dict[str, str | None], env: dict[str, str]
) -> str:
    """Drop ``distribution``'s cached builds if ``key`` differs from the last build's.

    Returns what happened: "first" (no key yet), "unchanged", or "changed" (cache cleaned). The
    key is stored in uv's cache directory, so it lives and dies with the builds it describes (an
    image build's cache mount, a host's ~/.cache/uv).
    """
    cache = uv_cache_dir(uv, env)
    record = cache / f"{KEY_PREFIX}{distribution}.json"
    digest = key_digest(key)
    previous = None
    if record.is_file():
        try:
            previous = json.loads(record.read_text()).get("sha256")
        except (OSError, ValueError):
            previous = "unreadable"
    state = "first" if previous is None else ("unchanged" if previous == digest else "changed")
    if state == "changed":
        subprocess.run([uv, "cache", "clean", distribution], env=env, check=True, timeout=600)
    cache.mkdir(parents=True, exist_ok=True)
    temp = record.with_suffix(f".tmp{os.getpid()}")
    temp.write_text(json.dumps({"sha256": digest, "key": key}, indent=2, sort_keys=True) + "\n")
    os.replace(temp, record)
    return state
