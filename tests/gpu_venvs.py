"""Bring the lock's backend venvs to a GPU machine that has no network, in parts.

Why: the probes' verdicts about real backends are only proven on a GPU, with the venvs users
get (make_venv from uv.lock), not the GPU machine's own torch. The device machine takes one
part of about 54 MiB per call beside the repository and keeps a warm machine for 30 s between
calls; tests/gpu_venvs_device.sh receives the parts there and unpacks them while they arrive.

Here, as root, from the repository root (DeepEP and NCCL sources through git mirrors, since
GitHub is not reachable from every build machine):

    python3 tests/gpu_venvs.py build --prefix /work/gpu/venvs \\
        --mirror https://github.com/deepseek-ai/DeepEP=/path/DeepEP.git \\
        --mirror https://github.com/NVIDIA/nccl=/path/nccl.git
    python3 tests/gpu_venvs.py pack --prefix /work/gpu/venvs --out .gpu

``build`` runs make_venv for every backend (TORCH_CUDA_ARCH_LIST=9.0), with what a machine
without a GPU driver lacks for the two source builds: driver stubs made from cuda.h and nvml.h
(tests/_ngc_standin.py) and the math libraries' headers (cusparse.h, ... from the venv's own
CUDA wheels) where the CUDA home has none. ``pack`` writes OUT/part.NNN, OUT/SHA256SUMS,
OUT/bundle.json (the venvs, the commit, the lock's sha256, sizes) and OUT/zstd: a tar of the
venvs and the interpreter they point at (its standard library and headers, not its own
site-packages), compressed with zstd's long window. On the device (evidence pages say which
calls): ``bash tests/gpu_venvs_device.sh receive`` once per part, then the probes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _ngc_standin import NVML_WHEEL, make_stub  # noqa: E402

from ep_image import backends  # noqa: E402

#: A part and the repository travel together in one call's 64 MiB.
PART_BYTES = 54 * 1024 * 1024
CUDA_HOME = Path("/usr/local/cuda")
#: rdma-core's run-time libraries: HybridEP's multi-node build links libibverbs and libmlx5,
#: which a GPU machine without RDMA packages lacks (the image installs them with APT_PACKAGES).
RDMA_LIBRARIES = ("libibverbs.so.1*", "libmlx5.so.1*", "libnl-3.so.200*", "libnl-route-3.so.200*")
SYSTEM_LIBS = Path("/usr/lib/x86_64-linux-gnu")
#: Headers torch's extension headers include that a CUDA home without the math libraries lacks.
MATH_HEADERS = ("cusparse", "cublas", "cufft", "curand", "cusolver", "nvJitLink")


def stand_ins(work: Path, headers_from: Path) -> dict[str, str]:
    """The build variables a source build needs on a machine without a driver (see module)."""
    stubs = work / "stubs"
    stubs.mkdir(parents=True, exist_ok=True)
    nvml = work / "nvml"
    nvml.mkdir(exist_ok=True)
    if not (stubs / "libcuda.so").exists():
        make_stub(CUDA_HOME / "include" / "cuda.h", "cu", "libcuda.so.1", stubs / "libcuda.so")
    if not next(nvml.rglob("nvml.h"), None):
        subprocess.run(
            ["uv", "pip", "install", "-q", "--no-deps", "--target", str(nvml), NVML_WHEEL],
            check=True,
        )
    if not (stubs / "libnvidia-ml.so.1").exists():
        header = next(nvml.rglob("nvml.h"))
        make_stub(header, "nvml", "libnvidia-ml.so.1", stubs / "libnvidia-ml.so")
        (stubs / "libnvidia-ml.so.1").symlink_to("libnvidia-ml.so")
    include = work / "math-include"
    include.mkdir(exist_ok=True)
    for header in sorted(headers_from.iterdir()):
        if (
            header.name.startswith(MATH_HEADERS)
            and not (CUDA_HOME / "include" / header.name).exists()
        ):
            target = include / header.name
            if not target.exists():
                (shutil.copytree if header.is_dir() else shutil.copy2)(header, target)
    # HybridEP's topology detection includes nvml.h, which a CUDA home without the driver's
    # development headers lacks (the NGC devel image has it).
    if not (CUDA_HOME / "include" / "nvml.h").exists():
        shutil.copy2(next(nvml.rglob("nvml.h")), include / "nvml.h")
    return {
        "LIBRARY_PATH": str(stubs),
        "CPLUS_INCLUDE_PATH": str(include),
        "C_INCLUDE_PATH": str(include),
    }


def build(args: argparse.Namespace) -> int:
    """Every backend's venv from the lock, as make_venv builds it on a host (see module)."""
    prefix: Path = args.prefix.resolve()
    work = prefix.parent / "build-stand-ins"
    gitconfig = work / "gitconfig"
    work.mkdir(parents=True, exist_ok=True)
    rules = "".join(
        f'[url "{local}"]\n\tinsteadOf = {url}\n\tinsteadOf = {url}.git\n'
        for url, local in (m.split("=", 1) for m in args.mirror)
    )
    gitconfig.write_text(rules + '[protocol "file"]\n\tallow = always\n')
    env = {
        **os.environ,
        "GIT_CONFIG_GLOBAL": str(gitconfig),
        "TORCH_CUDA_ARCH_LIST": args.arch_list,
        "MAX_JOBS": str(args.jobs),
    }
    names = [s.name for s in backends.SPECS]
    wheel_only = [n for n in names if not backends.spec(n).builds_from_source]
    make_venv = [sys.executable, "scripts/make_venv.py", "--prefix", str(prefix)]
    timings: dict[str, float] = {}
    for group in (wheel_only, [n for n in names if n not in wheel_only]):
        for name in group:
            if (prefix / name).exists():
                print(f"gpu_venvs: {prefix / name} exists, kept", flush=True)
                continue
            if name not in wheel_only:
                site = next((prefix / wheel_only[0]).glob("lib/python3*/site-packages"))
                env.update(stand_ins(work, site / "nvidia" / "cu13" / "include"))
            start = time.monotonic()
            proc = subprocess.run([*make_venv, "--backend", name], cwd=ROOT, env=env, check=False)
            timings[name] = round(time.monotonic() - start, 1)
            if proc.returncode != 0:
                print(f"gpu_venvs: make_venv --backend {name} failed ({proc.returncode})")
                return 1
    print(json.dumps({"built_seconds": timings}))
    return 0


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def interpreter_home(venv: Path) -> Path:
    """The installation the venv's python points at (pyvenv.cfg's ``home`` is its bin/)."""
    for line in (venv / "pyvenv.cfg").read_text().splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "home":
            return Path(value.strip()).resolve().parent
    raise SystemExit(f"gpu_venvs: {venv}/pyvenv.cfg names no home")


def rdma_core(prefix: Path) -> Path | None:
    """rdma-core's run-time libraries copied beside the venvs (``<prefix>/../rdma-core/lib``,
    for LD_LIBRARY_PATH on the GPU machine), when this machine has them."""
    found = [p for pattern in RDMA_LIBRARIES for p in sorted(SYSTEM_LIBS.glob(pattern))]
    if not found:
        return None
    lib = prefix.parent / "rdma-core" / "lib"
    if lib.exists():
        shutil.rmtree(lib)
    lib.mkdir(parents=True)
    for path in found:
        target = lib / path.name
        if path.is_symlink():
            target.symlink_to(os.readlink(path))
        else:
            shutil.copy2(path, target)
    providers = SYSTEM_LIBS / "libibverbs"
    if providers.is_dir():
        shutil.copytree(providers, lib / "libibverbs", symlinks=True)
    return lib.parent


def pack(args: argparse.Namespace) -> int:
    """The venvs and their interpreter as tar | zstd, split into parts (see module)."""
    prefix: Path = args.prefix.resolve()
    out: Path = args.out.resolve()
    venvs = sorted(p for p in prefix.iterdir() if (p / "pyvenv.cfg").is_file())
    if args.venv:
        missing = sorted(set(args.venv) - {v.name for v in venvs})
        if missing:
            raise SystemExit(f"gpu_venvs: no venv {', '.join(missing)} under {prefix}")
        venvs = [v for v in venvs if v.name in args.venv]
    if not venvs:
        raise SystemExit(f"gpu_venvs: no venv under {prefix}")
    home = interpreter_home(venvs[0])
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    stdlib = home / "lib" / version
    members = [str(v) for v in venvs]
    if args.interpreter:
        members += [str(home / "bin"), str(home / "include")]
        members += [str(p) for p in sorted((home / "lib").iterdir()) if p != stdlib]
        members += [
            str(p) for p in sorted(stdlib.iterdir()) if p.name not in ("site-packages", "test")
        ]
    rdma = rdma_core(prefix) if args.rdma_core else None
    if rdma is not None:
        members.append(str(rdma))
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    start = time.monotonic()
    with tempfile.NamedTemporaryFile("w", delete=False) as listing:
        listing.write("\n".join(m.lstrip("/") for m in members) + "\n")
    try:
        subprocess.run(
            f"set -o pipefail; tar -C / --numeric-owner -cf - -T {listing.name} "
            f"| zstd -{args.level} -T0 --long=27 -q -c "
            f"| split -b {args.part_bytes} -d -a 3 - {out}/part.",
            shell=True, check=True, executable="/bin/bash",
        )  # fmt: skip
    finally:
        os.unlink(listing.name)
    parts = sorted(out.glob("part.[0-9][0-9][0-9]"))
    (out / "SHA256SUMS").write_text("".join(f"{sha256(p)}  {p.name}\n" for p in parts))
    zstd = shutil.which("zstd")
    if zstd is None:
        raise SystemExit("gpu_venvs: zstd is not on PATH")
    shutil.copy2(zstd, out / "zstd")  # the GPU machine has none
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True, check=False).stdout.strip()  # fmt: skip
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True,
                           text=True, check=False).stdout.strip() != ""  # fmt: skip
    bundle = {
        "venvs": [v.name for v in venvs],
        "prefix": str(prefix),
        "interpreter": str(home) if args.interpreter else None,
        "rdma_core": str(rdma / "lib") if rdma is not None else None,
        "source_root": str(ROOT),
        "commit": commit,
        "dirty": dirty,
        "uv_lock_sha256": sha256(ROOT / "uv.lock"),
        "parts": len(parts),
        "bytes": sum(p.stat().st_size for p in parts),
        "seconds": round(time.monotonic() - start, 1),
    }
    (out / "bundle.json").write_text(json.dumps(bundle, indent=2) + "\n")
    print(json.dumps(bundle))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_venvs", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="every backend's venv from the lock (make_venv)")
    b.add_argument("--prefix", type=Path, required=True)
    b.add_argument("--mirror", action="append", default=[], metavar="URL=LOCAL")
    b.add_argument("--arch-list", default="9.0")
    b.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    p = sub.add_parser("pack", help="tar | zstd | split the venvs and their interpreter")
    p.add_argument("--prefix", type=Path, required=True)
    p.add_argument("--out", type=Path, default=ROOT / ".gpu")
    p.add_argument("--level", type=int, default=5)
    p.add_argument(
        "--venv",
        action="append",
        default=[],
        metavar="NAME",
        help="pack this venv of the prefix only (repeatable; default: every venv there)",
    )
    p.add_argument("--part-bytes", type=int, default=PART_BYTES)
    p.add_argument(
        "--no-interpreter",
        dest="interpreter",
        action="store_false",
        help="leave out the interpreter the venvs point at (the GPU machine has it there)",
    )
    p.add_argument(
        "--no-rdma-core",
        dest="rdma_core",
        action="store_false",
        help="leave out rdma-core's run-time libraries (HybridEP's multi-node build needs them)",
    )
    args = parser.parse_args(argv)
    return build(args) if args.command == "build" else pack(args)


if __name__ == "__main__":
    raise SystemExit(main())
