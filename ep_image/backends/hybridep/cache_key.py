"""The key of HybridEP's cached kernels: everything that changes the bytes nvcc writes for one of
HybridEP's own kernel keys.

Why a module of its own: HybridEP names a kernel by its template parameters alone
(``get_key()``), which is enough inside one process but not across builds: the same name
compiled from other headers, another ``hybrid_ep_cpp``, another nvcc or for another GPU is
another kernel. The shared cache keeps kernels under a directory named by a hash of all of
them, so a kernel of another build, CUDA or GPU is never loaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: What a key directory's hash was made of, for people reading the cache.
KEY_RECORD = "key.json"
KEY_SCHEMA = 1
_CHUNK = 1 << 20


class CacheOff(Exception):
    """The cache cannot be used here; the message says why (and goes into the report)."""


def arch_label(arch: str | tuple[int, int] | None, env: Mapping[str, str]) -> str:
    """``sm90`` from (9, 0), "9.0", "sm_90"; without one, the visible GPUs' compute
    capabilities from nvidia-smi; ``unknown`` when neither says."""
    if arch is None:
        arch = "+".join(_smi_capabilities(env)) or "unknown"
    if isinstance(arch, tuple):
        return f"sm{arch[0]}{arch[1]}"
    text = arch.strip().lower()
    parts = [_one_arch(part) for part in text.split("+")]
    return "+".join(parts)


def _one_arch(text: str) -> str:
    match = re.fullmatch(r"(?:sm_?)?(\d+)\.?(\d)([a-z]?)", text)
    if match:
        return f"sm{match[1]}{match[2]}{match[3]}"
    return re.sub(r"[^a-z0-9_.]", "_", text) or "unknown"


def _smi_capabilities(env: Mapping[str, str]) -> list[str]:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            env=dict(env),
        )
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode != 0:
        return []
    return sorted({line.strip() for line in out.stdout.splitlines() if line.strip()})


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _tree_digest(root: Path) -> str:
    """Names and bytes of every file under ``root`` (HybridEP's -I directory)."""
    digest = hashlib.sha256()
    files = sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    if not files:
        raise CacheOff(f"{root} holds no files: not an installed HybridEP")
    for path in files:
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(_file_digest(path).encode() + b"\0")
    return digest.hexdigest()


def _nvcc_version(nvcc: Path, env: Mapping[str, str]) -> str:
    try:
        out = subprocess.run(
            [str(nvcc), "--version"], capture_output=True, text=True, timeout=120, env=dict(env)
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise CacheOff(f"{nvcc} --version failed ({exc}): HybridEP cannot compile either") from None
    if out.returncode != 0 or not out.stdout.strip():
        raise CacheOff(f"{nvcc} --version exited {out.returncode}: HybridEP cannot compile either")
    return out.stdout.strip()


def find_package(package_dir: str | Path | None) -> tuple[Path, Path]:
    """The installed ``deep_ep`` directory (HybridEP's base_path) and its ``hybrid_ep_cpp``
    extension, found without importing either."""
    if package_dir is None:
        spec = importlib.util.find_spec("deep_ep")
        if spec is None or not spec.submodule_search_locations:
            raise CacheOff("deep_ep is not installed here")
        package_dir = next(iter(spec.submodule_search_locations))
    package = Path(package_dir)
    candidates = sorted(package.parent.glob("hybrid_ep_cpp*.so"))
    if not candidates:
        spec = importlib.util.find_spec("hybrid_ep_cpp")
        if spec is not None and spec.origin:
            candidates = [Path(spec.origin)]
    if not candidates:
        raise CacheOff(f"no hybrid_ep_cpp extension beside {package}: not a HybridEP build")
    return package, candidates[0]


def cache_key(
    package: Path, extension: Path, nvcc: Path, arch: str, env: Mapping[str, str]
) -> tuple[str, dict[str, Any]]:
    """The key directory's name and what it was hashed from: everything that changes the
    bytes nvcc writes for the same kernel key."""
    material = {
        "schema": KEY_SCHEMA,
        "backend_headers_sha256": _tree_digest(package / "backend"),
        "hybrid_ep_cpp_sha256": _file_digest(extension),
        "nvcc_version": _nvcc_version(nvcc, env),
        "arch": arch,
        # Read by HybridEP's inter-node JIT when built with NIXL.
        "nixl_home": env.get("NIXL_HOME", ""),
        "ucx_home": env.get("UCX_HOME", ""),
    }
    digest = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()
    return f"{arch}-{digest[:24]}", material
