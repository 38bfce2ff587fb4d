"""Facts about the running environment that every probe reports, gathered without side effects.

Which torch, NCCL, cuDNN, NVSHMEM and DeepEP build was loaded, and from where, never importing
``deep_ep`` or Transformer Engine (importing DeepEP v2 can abort the process); absent is
``None``, never an exception. See docs/probes.md, section "check-env".
"""

from __future__ import annotations

import ast
import ctypes
import importlib.metadata as metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

# Every probe imports this module before torch. The probes never use numpy, and must run where
# it is absent (a venv that leaves it out); torch's import warns about that on every run.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)


def dist_version(*names: str) -> tuple[str, str] | None:
    """``(name, version)`` of the first installed distribution among ``names``, else None."""
    for name in names:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def dist_direct_url(name: str) -> dict[str, Any] | None:
    """The PEP 610 ``direct_url.json`` of a distribution (git or local installs), if any."""
    try:
        text = metadata.distribution(name).read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


_LOCAL_SHA = re.compile(r"\+(?:g|git)?([0-9a-f]{7,40})(?:[._-].*)?$")


def commit_of(version: str | None, direct_url: dict[str, Any] | None) -> str | None:
    """The git commit a distribution was built from.

    A DeepEP built from git records it twice: its version carries ``+<shortsha>`` (setup.py
    appends ``git rev-parse --short HEAD``), and pip/uv write the full commit to
    ``direct_url.json``. The full one wins.
    """
    if direct_url:
        commit = (direct_url.get("vcs_info") or {}).get("commit_id")
        if commit:
            return str(commit)
    if version:
        match = _LOCAL_SHA.search(version)
        if match:
            return match.group(1)
    return None


def module_dir(name: str) -> Path | None:
    """Directory of a top-level package, found without importing it (None if absent)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(spec.origin).parent if spec.origin else None


def extension_path(name: str) -> str | None:
    """File of a top-level compiled extension module (``deep_ep_cpp``), found without loading."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None and spec.origin else None


def static_cxx_runtime(path: str) -> bool:
    """Whether a C++ extension carries its own copy of libstdc++ instead of linking the shared one.

    Such a build (a compiler wrapper adding ``-static-libstdc++`` made one on the GPU machine
    here) puts a second C++ runtime into a process where torch already loaded the shared
    one; HybridEP built that way died with SIGSEGV in iostream code inside its buffer
    constructor. The sign: ``std::`` symbols in the file, but no ``libstdc++.so.6`` among
    the libraries it asks the loader for.
    """
    return file_contains(path, b"_ZNSt") and not file_contains(path, b"libstdc++.so.6")


def file_contains(path: str, needle: bytes, chunk: int = 1 << 22) -> bool:
    """Whether the file at ``path`` contains ``needle`` (read in chunks; False if unreadable)."""
    try:
        with open(path, "rb") as fh:
            keep = len(needle) - 1  # bytes of a needle that may straddle the next read
            tail = b""
            while block := fh.read(chunk):
                window = tail + block
                if needle in window:
                    return True
                tail = window[-keep:] if keep else b""
    except OSError:
        return False
    return False


def providers_of(module: str) -> list[str]:
    """Distributions that install the top-level module ``module`` (from their RECORD files)."""
    try:
        mapping = metadata.packages_distributions()
    except Exception:
        return []
    return sorted(set(mapping.get(module, [])))


def read_literal_assignments(path: Path) -> dict[str, Any]:
    """Module-level ``NAME = <literal>`` assignments of a Python file, without executing it.

    Used for build-info modules such as sgl-deep-ep's ``deep_ep/_build_info.py``: importing
    it would import ``deep_ep`` itself.
    """
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return {}
    values: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                try:
                    values[target.id] = ast.literal_eval(node.value)
                except ValueError:
                    continue
    return values


def parse_maps(text: str) -> list[str]:
    """File paths mapped into a process, in first-seen order, from ``/proc/<pid>/maps`` text.

    Each maps line is ``address perms offset dev inode [path]``; anonymous and pseudo entries
    (``[heap]``, ``[vdso]``) are dropped. Paths may contain spaces, so the path is everything
    after the inode field.
    """
    seen: dict[str, None] = {}
    for line in text.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) < 6:
            continue
        path = parts[5].strip()
        if path.endswith(" (deleted)"):
            path = path[: -len(" (deleted)")]
        if path.startswith("/"):
            seen.setdefault(path, None)
    return list(seen)


def mapped_libraries(pattern: str, maps_text: str | None = None) -> list[str]:
    """Mapped files whose base name matches the regex ``pattern`` (``^libcudnn\\.so``)."""
    if maps_text is None:
        try:
            maps_text = Path("/proc/self/maps").read_text()
        except OSError:
            return []
    regex = re.compile(pattern)
    return [path for path in parse_maps(maps_text) if regex.search(os.path.basename(path))]


def is_cuda_home(path: Path) -> bool:
    """A CUDA toolkit's root: it holds the runtime's headers, which every CUDA build needs."""
    return (path / "include" / "cuda_runtime.h").is_file()


def nvcc_own_dir(nvcc: str) -> Path | None:
    """The directory the nvcc that ``nvcc`` runs lives in, as nvcc itself reports it
    (``_HERE_`` of ``nvcc -dryrun``), so that a wrapper script elsewhere is seen through."""
    try:
        proc = subprocess.run(
            [nvcc, "-dryrun", "-E", "-x", "cu", os.devnull],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"^#\$ _HERE_=(.+)$", proc.stdout + proc.stderr, re.M)
    return Path(match.group(1).strip()) if match else None


def cuda_home() -> tuple[str | None, str]:
    """The CUDA toolkit directory and how it was found, the way DeepEP v2 looks for it.

    Order: ``CUDA_HOME``, ``CUDA_PATH``, the parent of ``nvcc`` on PATH, ``/usr/local/cuda``.
    """
    for var in ("CUDA_HOME", "CUDA_PATH"):
        value = os.environ.get(var)
        if value:
            return value, var
    nvcc = shutil.which("nvcc")
    if nvcc:
        return str(Path(os.path.realpath(nvcc)).parent.parent), "nvcc on PATH"
    if Path("/usr/local/cuda").is_dir():
        return "/usr/local/cuda", "/usr/local/cuda"
    return None, "not found"


def toolkit_home() -> tuple[str | None, str]:
    """The CUDA toolkit this environment has, and how it was found: what a report names.

    Order: ``CUDA_HOME``, ``CUDA_PATH``, then the toolkit of ``nvcc`` on PATH: the parent of
    its bin/ through symbolic links, or, where that holds no include/cuda_runtime.h (a wrapper
    script in /usr/local/bin), the directory nvcc itself reports; then ``/usr/local/cuda``.
    :func:`cuda_home` is the lookup a JIT backend makes, which takes the wrapper's parent:
    ``found_by`` says when the two differ and that ``CUDA_HOME`` is the fix.
    """
    for var in ("CUDA_HOME", "CUDA_PATH"):
        value = os.environ.get(var)
        if value:
            return value, var
    nvcc = shutil.which("nvcc")
    if nvcc:
        home = Path(os.path.realpath(nvcc)).parent.parent
        if is_cuda_home(home):
            return str(home), "nvcc on PATH"
        own = nvcc_own_dir(nvcc)
        if own is not None and is_cuda_home(own.parent):
            return str(own.parent), (
                f"nvcc on PATH: {nvcc} runs {own / 'nvcc'} (builds and JIT backends that take "
                f"nvcc's parent as the CUDA home need CUDA_HOME={own.parent})"
            )
    return cuda_home()


def nvcc_version(home: str | None) -> tuple[str | None, str | None]:
    """``(path, "13.0.88")`` of the nvcc in ``home/bin`` (else on PATH); Nones when absent."""
    candidates = []
    if home:
        candidates.append(str(Path(home) / "bin" / "nvcc"))
    on_path = shutil.which("nvcc")
    if on_path:
        candidates.append(on_path)
    for nvcc in candidates:
        if not os.access(nvcc, os.X_OK):
            continue
        try:
            out = subprocess.run(
                [nvcc, "--version"], capture_output=True, text=True, timeout=60, check=False
            ).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        match = re.search(r"V(\d+\.\d+\.\d+)", out) or re.search(r"release (\d+\.\d+)", out)
        if match:
            return nvcc, match.group(1)
    return None, None


def nvidia_smi() -> list[dict[str, str]] | None:
    """GPU name, driver and memory per GPU from ``nvidia-smi`` (None when it is absent)."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run(
            [
                exe,
                "--query-gpu=index,name,driver_version,memory.total",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    gpus = []
    for line in out.stdout.strip().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) >= 4:
            gpus.append(
                {"index": fields[0], "name": fields[1], "driver": fields[2], "memory": fields[3]}
            )
    return gpus


def decode_cudnn_version(value: int) -> tuple[int, int, int]:
    """``cudnnGetVersion()``'s integer as (major, minor, patch).

    cuDNN 9 encodes ``major*10000 + minor*100 + patch`` (9.20.0 -> 92000); cuDNN 8 and older
    encoded ``major*1000 + minor*100 + patch`` (8.9.7 -> 8907).
    """
    if value >= 90000:
        return value // 10000, (value % 10000) // 100, value % 100
    return value // 1000, (value % 1000) // 100, value % 100


def parse_version_triplet(text: str | None) -> tuple[int, int, int] | None:
    """``"9.24.0.43"`` or ``"9.20"`` as (9, 24, 0) / (9, 20, 0); None if it has no numbers."""
    if not text:
        return None
    nums = [int(n) for n in re.findall(r"\d+", str(text))[:3]]
    if not nums:
        return None
    while len(nums) < 3:
        nums.append(0)
    return nums[0], nums[1], nums[2]


def loaded_cudnn(load_if_absent: bool = True) -> dict[str, Any]:
    """The cuDNN library this process actually uses: its path and ``cudnnGetVersion()``.

    The library is looked up in ``/proc/self/maps`` (what the dynamic loader chose, which is
    the whole question when two copies exist); ``load_if_absent`` loads ``libcudnn.so.9``
    by soname first, as torch would. Returns ``{"path": None, ...}`` when there is none.
    """
    paths = mapped_libraries(r"^libcudnn\.so")
    if not paths and load_if_absent:
        for soname in ("libcudnn.so.9", "libcudnn.so.8", "libcudnn.so"):
            try:
                ctypes.CDLL(soname)
                break
            except OSError:
                continue
        paths = mapped_libraries(r"^libcudnn\.so")
    info: dict[str, Any] = {"path": None, "version": None, "all_mapped": paths, "versions": {}}
    if not paths:
        return info
    for path in paths:
        raw, error = cudnn_version_at(path)
        info["versions"][path] = "{}.{}.{}".format(*decode_cudnn_version(raw)) if raw else None
        if path == paths[0]:
            info["path"] = path
            if raw is None:
                info["error"] = error
            else:
                info["raw"] = raw
                info["version"] = info["versions"][path]
    return info


def cudnn_version_at(path: str) -> tuple[int | None, str | None]:
    """``cudnnGetVersion()`` of the library file at ``path`` (already mapped: same handle)."""
    try:
        lib = ctypes.CDLL(path)
        lib.cudnnGetVersion.restype = ctypes.c_size_t
        return int(lib.cudnnGetVersion()), None
    except (OSError, AttributeError) as exc:
        return None, f"cudnnGetVersion failed: {exc}"


DEFAULT_TE_BUILD_INFO = "/opt/venvs/te-build.json"
# Names under which a Transformer Engine install may be registered (source build or PyPI parts).
TE_DISTRIBUTIONS = (
    "transformer-engine",
    "transformer_engine",
    "transformer-engine-torch",
    "transformer-engine-cu13",
    "transformer-engine-cu12",
)


def te_build_info_candidates(prefix: str | None = None) -> list[str]:
    """Where a te-build.json is looked for when none is named: in the directory that holds this
    venv (``<prefix>/te-build.json``, where the image keeps it for its venvs), then the image's
    own path, for a Python outside ``/opt/venvs`` in the image."""
    beside = str(Path(prefix or sys.prefix).parent / "te-build.json")
    return list(dict.fromkeys([beside, DEFAULT_TE_BUILD_INFO]))


def te_build_info_path(flag: str | None = None, prefix: str | None = None) -> str | None:
    """Where build_te.py's te-build.json is: the flag, ``EP_TE_BUILD_INFO``, else the first of
    :func:`te_build_info_candidates` that exists; None when there is none."""
    named = flag or os.environ.get("EP_TE_BUILD_INFO")
    if named:
        return named
    return next((p for p in te_build_info_candidates(prefix) if Path(p).is_file()), None)


def no_te_build_info() -> str:
    """What to say where no te-build.json was named and none was found."""
    looked = ", ".join(te_build_info_candidates())
    return f"no te-build.json (looked at {looked}; --te-build-info or EP_TE_BUILD_INFO names one)"


def read_json_file(path: str) -> dict[str, Any] | None:
    """A JSON object from ``path``; None when the file is absent or not a JSON object."""
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def loaded_nccl_version() -> str | None:
    """The version of the libnccl this process has loaded (``ncclGetVersion``), or None.

    Not ``torch.cuda.nccl.version()``: that is the NCCL torch was compiled against, which
    stays 2.28.9 on a machine whose torch loads a newer libnccl, and DeepEP v2's minimum
    is about the loaded library.
    """
    import ctypes

    mapped = mapped_libraries(r"^libnccl\.so")
    try:
        lib = ctypes.CDLL(mapped[0] if mapped else "libnccl.so.2")
        code = ctypes.c_int()
        if lib.ncclGetVersion(ctypes.byref(code)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    value = code.value
    major, minor, patch = (
        (value // 10000, value // 100 % 100, value % 100)
        if value >= 10000
        else (value // 1000, value // 100 % 10, value % 100)
    )
    return f"{major}.{minor}.{patch}"


def torch_facts() -> dict[str, Any]:
    """Versions torch reports about itself and its CUDA stack (imports torch)."""
    import torch

    facts: dict[str, Any] = {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "nccl": None,
        "cudnn": None,
    }
    facts["nccl"] = loaded_nccl_version()
    try:
        built = torch.cuda.nccl.version()
        facts["nccl_torch_built_with"] = (
            ".".join(map(str, built)) if isinstance(built, tuple) else str(built)
        )
    except Exception:
        facts["nccl_torch_built_with"] = None
    facts["nccl"] = facts["nccl"] or facts["nccl_torch_built_with"]
    try:
        cudnn = torch.backends.cudnn.version()
        facts["cudnn"] = "{}.{}.{}".format(*decode_cudnn_version(int(cudnn))) if cudnn else None
    except Exception:
        facts["cudnn"] = None
    if facts["cuda_available"]:
        facts["devices"] = [
            torch.cuda.get_device_name(i) for i in range(int(facts["device_count"]))
        ]
    return facts


def version_at_least(version: str | None, minimum: tuple[int, ...]) -> bool | None:
    """``version >= minimum`` comparing leading integers; None when ``version`` is unknown."""
    if not version:
        return None
    nums = tuple(int(n) for n in re.findall(r"\d+", version)[: len(minimum)])
    if not nums:
        return None
    return nums >= minimum
