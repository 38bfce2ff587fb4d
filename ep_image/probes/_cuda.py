"""The CUDA toolkit and the GPUs, as a report names them: where the toolkit is and how it was
found, its nvcc's version, and what ``nvidia-smi`` says of each GPU; absent is ``None``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path


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


def _named_home() -> tuple[str, str] | None:
    """The toolkit the environment names (``CUDA_HOME``, then ``CUDA_PATH``), and which."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        value = os.environ.get(var)
        if value:
            return value, var
    return None


def cuda_home() -> tuple[str | None, str]:
    """The CUDA toolkit directory and how it was found, the way DeepEP v2 looks for it.

    Order: ``CUDA_HOME``, ``CUDA_PATH``, the parent of ``nvcc`` on PATH, ``/usr/local/cuda``.
    """
    named = _named_home()
    if named is not None:
        return named
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
    named = _named_home()
    if named is not None:
        return named
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
