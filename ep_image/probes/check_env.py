#!/usr/bin/env python3
"""check_env: one manifest of what this environment holds, for bug reports and image records.

Every EP or TE failure report starts with "which versions?"; this probe answers in one table and
one JSON file, anywhere, without importing the EP backend (``deep_ep``, ``nccl.ep``) or
Transformer Engine. See docs/probes.md, section "check-env".
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ep_image import backends as registry
from ep_image import cli
from ep_image.probes import (
    _backend_detect,
    _cuda,
    _cudnn_libs,
    _installed,
    _mapped,
    _te,
    _torch_stack,
    _venv_record,
)
from ep_image.probes._report import EXIT_OK, SCHEMA_VERSION, one_line, write_report

PROG = "check_env"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.Parser(
        prog="check_env.py",
        description=(
            "Print (and with --json write) the versions this environment holds: Python, torch "
            "and its CUDA, Transformer Engine, cuDNN built-against and loaded, NCCL, NVSHMEM, "
            "the EP backend with its version and commit (and its native library, where it has "
            "one: path, release, the NCCL it binds to), the GPU and driver, EP_BACKEND. "
            "Absent things are null; the probe exits 0 whatever it finds."
        ),
    )
    parser.add_json("write the manifest here as JSON")
    parser.add_argument(
        "--te-build-info",
        metavar="PATH",
        help="te-build.json written by build_te.py (default: $EP_TE_BUILD_INFO, else the one in "
        f"the directory holding this venv, else {_te.DEFAULT_TE_BUILD_INFO}, else none)",
    )
    return parser.parse_args(argv)


def _dist(*names: str) -> dict[str, Any] | None:
    found = _installed.dist_version(*names)
    return {"distribution": found[0], "version": found[1]} if found else None


def torch_section() -> tuple[dict[str, Any] | None, str | None]:
    """torch's own view of itself (None when torch is absent or does not import)."""
    if _installed.module_dir("torch") is None:
        return None, None
    try:
        return _torch_stack.torch_facts(), None
    except Exception as exc:  # a broken torch is a fact to report, not a crash
        return None, one_line(f"{type(exc).__name__}: {exc}")


def backend_library(backend: str | None, module_dir: str | None) -> dict[str, Any] | None:
    """What the backend's registry package reads of its native library (NCCL EP's
    libnccl_ep.so: path, release, the libnccl.so.2 it binds to, its JIT's inputs), or None."""
    if not backend or not module_dir:
        return None
    try:
        return registry.backend_facts(backend, Path(module_dir)) or None
    except Exception as exc:  # a fact to report, not a crash
        return {"error": one_line(f"{type(exc).__name__}: {exc}")}


def collect(te_build_info: str | None = None) -> dict[str, Any]:
    """Everything the manifest reports; each probe is independent and failure-tolerant."""
    torch_info, torch_error = torch_section()
    build_info_path = _te.te_build_info_path(te_build_info)
    build_info = _te.read_json_file(build_info_path) if build_info_path else None
    loaded = _cudnn_libs.loaded_cudnn(load_if_absent=torch_info is not None) if torch_info else None
    installed = _backend_detect.detect_installed()
    cuda_home, cuda_home_from = _cuda.toolkit_home()
    nvcc, nvcc_version = _cuda.nvcc_version(cuda_home)
    te_dir = _installed.module_dir("transformer_engine")
    gpus = _cuda.nvidia_smi()
    nccl_mapped = _mapped.mapped_libraries(r"^libnccl\.so")

    return {
        "python": {
            "version": platform.python_version(),
            "executable": sys.executable,
            "prefix": sys.prefix,
        },
        "torch": torch_info,
        "torch_error": torch_error,
        "cuda_toolkit": {
            "home": cuda_home,
            "found_by": cuda_home_from,
            "nvcc": nvcc,
            "nvcc_version": nvcc_version,
        },
        "transformer_engine": {
            "dist": _dist(*_te.TE_DISTRIBUTIONS),
            "module_dir": str(te_dir) if te_dir else None,
            "build_info_path": build_info_path,
            "build_info": build_info,
        },
        "cudnn": {
            "built": (build_info or {}).get("cudnn_version"),
            "loaded": (loaded or {}).get("version"),
            "loaded_path": (loaded or {}).get("path"),
            "torch_reports": (torch_info or {}).get("cudnn"),
            "dist": _dist("nvidia-cudnn-cu13", "nvidia-cudnn-cu12"),
        },
        "nccl": {
            "torch_reports": (torch_info or {}).get("nccl"),
            "dist": _dist("nvidia-nccl-cu13", "nvidia-nccl-cu12"),
            "loaded_path": nccl_mapped[0] if nccl_mapped else None,
        },
        "nvshmem": {
            "dist": _dist("nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12"),
            "NVSHMEM_DIR": os.environ.get("NVSHMEM_DIR"),
        },
        "ep_backend": {
            "EP_BACKEND": os.environ.get("EP_BACKEND"),
            "EP_PREFIX": os.environ.get("EP_PREFIX"),
            "detected": installed.backend,
            "distribution": installed.distribution,
            "version": installed.version,
            "commit": installed.commit,
            "commit_source": installed.commit_source or None,
            "upstream": installed.upstream,
            "module_dir": installed.module_dir,
            "build_info": installed.build_info or None,
            "how": installed.reason,
            "module": installed.module,
            "library": backend_library(installed.backend, installed.module_dir),
        },
        "gpu": {
            "nvidia_smi": gpus,
            "driver": gpus[0]["driver"] if gpus else None,
            "torch_devices": (torch_info or {}).get("devices"),
        },
    }


def _fmt(value: Any) -> str:
    return "null" if value is None or value == "" else str(value)


def table(m: dict[str, Any]) -> str:
    """The manifest as aligned ``key  value`` rows, one concern per row."""
    t = m["torch"] or {}
    te = m["transformer_engine"]
    ep = m["ep_backend"]
    te_dist = te["dist"] or {}

    def dist_text(d: dict[str, Any] | None) -> str:
        return f"{d['version']} ({d['distribution']})" if d else "null"

    gpu = m["gpu"]
    gpu_text = (
        ", ".join(f"{g['name']} ({g['memory']})" for g in gpu["nvidia_smi"])
        if gpu["nvidia_smi"]
        else _fmt(", ".join(gpu["torch_devices"] or []) or None)
    )
    backend = ep["detected"]
    if backend:
        backend += f" = {ep['distribution']} {ep['version']}"
        backend += f" @ {ep['commit']}" if ep["commit"] else f" (commit {ep['commit_source']})"
        if ep["upstream"]:
            backend += f" from {ep['upstream']}"
    toolkit = m["cuda_toolkit"]
    torch_text = f"{_fmt(t.get('version'))} CUDA {_fmt(t.get('cuda'))}"
    if m["torch_error"]:
        torch_text += f" [{m['torch_error']}]"
    te_text = _fmt(te_dist.get("version"))
    if te["module_dir"]:
        te_text += f" at {te['module_dir']}"
    if te["build_info_path"] is None:
        built_text = f"null, {_te.no_te_build_info()}"
    else:
        built_text = f"{_fmt(m['cudnn']['built'])} (from {te['build_info_path']}"
        built_text += ")" if te["build_info"] else ": absent)"
    nccl, nvshmem = m["nccl"], m["nvshmem"]
    library = ep.get("library") or {}
    library_text = (
        f"{_fmt(library.get('library'))} (release {_fmt(library.get('library_release'))}), "
        + (
            f"binds NCCL {_fmt(library.get('nccl_bound_release'))} {library['nccl_bound']}"
            if library.get("nccl_bound")
            else "the loader finds no libnccl.so.2 for it"
        )
    )
    nvshmem_text = f"wheel {dist_text(nvshmem['dist'])}, NVSHMEM_DIR {_fmt(nvshmem['NVSHMEM_DIR'])}"
    rows = [
        ("python", f"{m['python']['version']} ({m['python']['executable']})"),
        ("torch", torch_text),
        ("cuda toolkit", f"{_fmt(toolkit['home'])} nvcc {_fmt(toolkit['nvcc_version'])}"),
        ("transformer engine", te_text),
        ("cudnn built (TE)", built_text),
        ("cudnn loaded", f"{_fmt(m['cudnn']['loaded'])} {_fmt(m['cudnn']['loaded_path'])}"),
        ("cudnn wheel", dist_text(m["cudnn"]["dist"])),
        ("nccl", f"torch {_fmt(nccl['torch_reports'])}, wheel {dist_text(nccl['dist'])}"),
        ("nvshmem", nvshmem_text),
        ("ep backend", _fmt(backend)),
        *([("ep library", library_text)] if library else []),
        ("EP_BACKEND", _fmt(ep["EP_BACKEND"])),
        ("gpu", gpu_text),
        ("driver", _fmt(gpu["driver"])),
    ]
    width = max(len(k) for k, _ in rows)
    return "check_env\n" + "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def run(args: argparse.Namespace) -> int:
    manifest = collect(args.te_build_info)
    print(table(manifest), flush=True)
    if args.json:
        report = {"schema_version": SCHEMA_VERSION, "probe": "check_env", **manifest}
        report["environment"] = _venv_record.environment_facts()
        write_report(args.json, report)
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    return cli.run(PROG, parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
