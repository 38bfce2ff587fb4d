"""NCCL EP's native library as installed, read from files: which ``libnccl_ep.so`` the wheel
loads, the release it was built as, the ``libnccl.so.2`` the loader binds it to, and what its JIT
runtime reads.

Why a module: the library needs the GPU driver to load (``libcuda.so.1``), so on a build host,
in CI and in check-env its facts must come from the files; check-ep's adapter and check-env both
report them. Standard library only (plus ep_image's loader trace); never imports ``nccl``.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import re
import shutil
from pathlib import Path

from ep_image.native import loader

LIBRARY = "libnccl_ep.so"
#: ``nccl.ep`` loads ``lib/cu<major>/libnccl_ep.so`` for the major of the installed
#: cuda-bindings (nccl/_extensions/_runtime.py in nccl-extensions 0.1.0).
CUDA_BINDINGS = "cuda-bindings"
#: Where the JIT runtime keeps compiled kernels when NCCL_EP_JIT_CACHE_DIR is unset (its
#: libnccl_ep.so, nccl-extensions 0.1.0): a directory every user of the machine shares.
DEFAULT_JIT_CACHE = "/tmp/nccl_ep/jit"

_DEFINE = re.compile(rb"#define\s+NCCL_EP_(MAJOR|MINOR|PATCH)\s+(\d+)")
_NCCL_VERSION = re.compile(rb"NCCL version (\d+\.\d+\.\d+)")
_NCCL_HEADER = re.compile(rb"#define\s+NCCL_(MAJOR|MINOR|PATCH)\s+(\d+)")


def cuda_major() -> str | None:
    """The CUDA major that selects the bundled library: the installed cuda-bindings'."""
    try:
        return metadata.version(CUDA_BINDINGS).split(".", 1)[0]
    except metadata.PackageNotFoundError:
        return None


def library_file(module_dir: Path, major: str | None = None) -> Path | None:
    """The ``libnccl_ep.so`` that ``nccl.ep`` loads (None: no cuda-bindings, or none bundled)."""
    major = major or cuda_major()
    path = module_dir / "lib" / f"cu{major}" / LIBRARY if major else None
    return path if path is not None and path.is_file() else None


def header_release(module_dir: Path) -> str | None:
    """The release the bundled headers declare (``include/nccl_ep.h``: NCCL_EP_MAJOR, _MINOR,
    _PATCH), which the library was built from and its JIT compiles against."""
    return include_release(module_dir / "include")


def include_release(include_dir: Path) -> str | None:
    """The release of ``include_dir/nccl_ep.h``: the directory that holds ``nccl_ep/``, the JIT's
    source directory (``NCCL_EP_JIT_SOURCE_DIR``, default ``$NCCL_EP_HOME/include/nccl_ep``)."""
    return _release(include_dir / "nccl_ep.h", _DEFINE)


def nccl_header_release(include_dir: Path) -> str | None:
    """The NCCL release of ``include_dir/nccl.h`` (NCCL_MAJOR, _MINOR, _PATCH)."""
    return _release(include_dir / "nccl.h", _NCCL_HEADER)


def nccl_file_release(library: Path) -> str | None:
    """The release a ``libnccl.so.2`` file carries ("NCCL version 2.30.7+cuda13.3"), read
    without loading it."""
    try:
        with library.open("rb") as fh:
            tail = b""
            while block := fh.read(1 << 22):
                if found := _NCCL_VERSION.search(tail + block):
                    return found.group(1).decode()
                tail = block[-64:]
    except OSError:
        return None
    return None


def binds_to_nccl(library: Path, site: Path) -> str | None:
    """The ``libnccl.so.2`` the loader binds ``library`` to in this venv, torch's libraries
    mapped first as in a training process (None: not found)."""
    try:
        direct, _ = loader.resolve(library, loader.torch_first(site))
    except loader.LoaderError:
        return None
    found = direct.get("libnccl.so.2")
    return os.path.realpath(found) if found else None


def jit_inputs(module_dir: Path, env: dict[str, str] | None = None) -> dict[str, str | None]:
    """What the JIT runtime compiles with, resolved as it resolves them (its nvcc_compiler and
    jit_runtime at nccl-extensions 0.1.0): ``import nccl.ep`` sets NCCL_EP_HOME and NCCL_HOME
    to the installed packages where they are not set at all; set but empty, the runtime falls
    back to its built-in /usr/include."""
    environ = dict(os.environ if env is None else env)
    ep_home = environ["NCCL_EP_HOME"] if "NCCL_EP_HOME" in environ else str(module_dir)
    nccl_home = environ["NCCL_HOME"] if "NCCL_HOME" in environ else _nccl_package_home(module_dir)
    cache = environ.get("NCCL_EP_JIT_CACHE_DIR")
    cuda_home = environ.get("CUDA_HOME") or environ.get("CUDA_PATH") or ""
    nvcc = environ.get("NCCL_EP_JIT_NVCC") or environ.get("NVCC")
    if not nvcc and cuda_home and Path(cuda_home, "bin", "nvcc").exists():
        nvcc = str(Path(cuda_home, "bin", "nvcc"))
    nvcc = nvcc or shutil.which("nvcc", path=environ.get("PATH"))
    return {
        "nvcc": nvcc,
        "source_dir": environ.get("NCCL_EP_JIT_SOURCE_DIR")
        or (str(Path(ep_home) / "include" / "nccl_ep") if ep_home else "/usr/include/nccl_ep"),
        "nccl_include_dir": environ.get("NCCL_EP_JIT_BUILD_INCLUDE_DIR")
        or (str(Path(nccl_home) / "include") if nccl_home else "/usr/include"),
        "cuda_include_dir": environ.get("NCCL_EP_JIT_CUDA_INCLUDE_DIR")
        or (str(Path(cuda_home) / "include") if cuda_home else None),
        "cache_dir": cache or DEFAULT_JIT_CACHE,
        "cache_from": "NCCL_EP_JIT_CACHE_DIR" if cache else "default",
    }


def facts(module_dir: Path) -> dict[str, object]:
    """check-env's facts of the installed library, none of them needing the driver."""
    library = library_file(module_dir)
    site = module_dir.parents[1]
    nccl = binds_to_nccl(library, site) if library else None
    return {
        "library": str(library) if library else None,
        "library_release": header_release(module_dir),
        "cuda_major": cuda_major(),
        "nccl_bound": nccl,
        "nccl_bound_release": nccl_file_release(Path(nccl)) if nccl else None,
        "jit": jit_inputs(module_dir),
    }


def _nccl_package_home(module_dir: Path) -> str | None:
    """The nvidia-nccl wheel's directory beside ``nccl/ep`` (what ``import nccl.ep`` sets as
    NCCL_HOME when it has headers)."""
    home = module_dir.parents[1] / "nvidia" / "nccl"
    return str(home) if (home / "include").is_dir() else None


def _release(header: Path, pattern: re.Pattern[bytes]) -> str | None:
    try:
        parts = dict(pattern.findall(header.read_bytes()))
    except OSError:
        return None
    if {b"MAJOR", b"MINOR", b"PATCH"} - parts.keys():
        return None
    return ".".join(parts[k].decode() for k in (b"MAJOR", b"MINOR", b"PATCH"))
