"""A local stand-in for the NGC CUDA *devel* base image, for building the full image without a
registry (tests/gpu_image.py).

Why: ``nvcr.io/nvidia/cuda:13.0.2-cudnn-devel-ubuntu24.04`` cannot be pulled here. What the
image's stages and its run time need from it is a CUDA 13.0 home at /usr/local/cuda with nvcc,
the math libraries' headers and libraries, the driver stubs (libcuda.so, libnvidia-ml.so in
lib64/stubs: DeepEP v1 and HybridEP link against them on a machine without a GPU driver), and an
older cuDNN in the system library path (NGC's own, which the image's venv cuDNN must shadow).
The stand-in has each of them, on the image tests' Debian base (tests/_buildah.py):

- the CUDA home: this machine's CUDA 13.0 toolkit (nvcc 13.0.88, runtime, CCCL, NVVM), plus the
  math libraries (cuBLAS, cuSPARSE, cuFFT, cuRAND, cuSOLVER, NVRTC, nvJitLink) and nvml.h from
  NVIDIA's wheels at the versions uv.lock pins (the same files the venvs hold), and cuobjdump
  (DeepEP v2's JIT runs it);
- the driver stubs, generated from cuda.h and nvml.h: every entry point as an exported symbol,
  sonames libcuda.so.1 and libnvidia-ml.so.1, as the toolkit's own stubs are;
- cuDNN 9.14.0 (every sub-library) in /usr/lib/x86_64-linux-gnu, with its headers, as the NGC
  cudnn images ship theirs (the H200's system library path holds the same release).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from _buildah import CACHE, Buildah, commit_base_image

ROOT = Path(__file__).resolve().parents[1]

#: The CUDA home copied into the stand-in (this machine's CUDA 13.0 toolkit).
HOST_CUDA = Path("/usr/local/cuda-13.0")
#: NVIDIA's wheels whose headers and libraries complete the CUDA home (versions from uv.lock).
MATH_WHEELS = (
    "nvidia-cublas",
    "nvidia-cusparse",
    "nvidia-cufft",
    "nvidia-curand",
    "nvidia-cusolver",
    "nvidia-cuda-nvrtc",
    "nvidia-nvjitlink",
)
#: nvml.h (HybridEP's multi-node build includes it); not in uv.lock.
NVML_WHEEL = "nvidia-nvml-dev==13.0.87"
#: cuobjdump, which DeepEP v2's JIT runs from $CUDA_HOME/bin at run time (NGC's devel image has
#: it; this machine's toolkit does not). 13.2.51 is the oldest CUDA 13 release on PyPI.
CUOBJDUMP_WHEEL = "nvidia-cuda-cuobjdump==13.2.51"
#: The base image's own, older cuDNN (NGC 13.0.2 images and the H200 carry 9.14).
BASE_CUDNN = "nvidia-cudnn-cu13==9.14.0.64"
#: The NGC CUDA images' own environment: the driver that a container runtime mounts at
#: /usr/local/nvidia is found through it, and the devel image links against the stubs.
NGC_ENV = {
    "PATH": "/usr/local/nvidia/bin:/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:"
    "/usr/sbin:/usr/bin:/sbin:/bin",
    "LD_LIBRARY_PATH": "/usr/local/nvidia/lib:/usr/local/nvidia/lib64",
    "LIBRARY_PATH": "/usr/local/cuda/lib64/stubs",
    "NVIDIA_VISIBLE_DEVICES": "all",
    "NVIDIA_DRIVER_CAPABILITIES": "compute,utility",
}
RECIPE_VERSION = 3


def locked_pins(names: tuple[str, ...]) -> list[str]:
    """``name==version`` for each of ``names`` as uv.lock pins it."""
    import tomllib

    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    versions = {p["name"]: p["version"] for p in lock["package"]}
    return [f"{name}=={versions[name]}" for name in names]


def recipe() -> dict[str, object]:
    nvcc = (
        subprocess.run(
            [str(HOST_CUDA / "bin" / "nvcc"), "--version"],
            capture_output=True,
            text=True,
            check=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    return {
        "math": locked_pins(MATH_WHEELS),
        "nvml": NVML_WHEEL,
        "tools": CUOBJDUMP_WHEEL,
        "cudnn": BASE_CUDNN,
        "nvcc": nvcc,
        "env": NGC_ENV,
        "version": RECIPE_VERSION,
    }


def recipe_key() -> str:
    return hashlib.sha256(json.dumps(recipe(), sort_keys=True).encode()).hexdigest()[:12]


def stub_symbols(header: Path, prefix: str) -> list[str]:
    """Every API entry point ``header`` declares or ``#define``s to a versioned name."""
    text = header.read_text(errors="replace")
    names = set(re.findall(rf"\b({prefix}[A-Z]\w*)\s*\(", text))
    names |= set(re.findall(rf"#define\s+{prefix}[A-Z]\w*\s+({prefix}[A-Z]\w*)\b", text))
    return sorted(n for n in names if not n.endswith("_t"))


def make_stub(header: Path, prefix: str, soname: str, out: Path) -> int:
    """A shared library exporting each entry point of ``header`` (the driver's, at link time
    only: loading it at run time is an error, as with NVIDIA's own stubs)."""
    symbols = stub_symbols(header, prefix)
    source = out.with_suffix(".c")
    source.write_text("".join(f"int {name}(void) {{ return 999; }}\n" for name in symbols))
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-O0", f"-Wl,-soname,{soname}", "-o", str(out), str(source)],
        check=True,
    )
    source.unlink()
    return len(symbols)


def cuda_home(work: Path) -> Path:
    """The stand-in CUDA home, assembled under ``work`` (see the module docstring)."""
    home = work / "cuda-13.0"
    shutil.copytree(HOST_CUDA, home, symlinks=True)
    wheels = work / "wheels"
    subprocess.run(
        [
            "uv",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--target",
            str(wheels),
            *locked_pins(MATH_WHEELS),
            NVML_WHEEL,
            CUOBJDUMP_WHEEL,
        ],
        check=True,
        timeout=1800,
    )
    cu13 = wheels / "nvidia" / "cu13"
    for tool in (cu13 / "bin").iterdir():
        if not (home / "bin" / tool.name).exists():
            shutil.move(str(tool), home / "bin" / tool.name)
    for header in (cu13 / "include").iterdir():
        if not (home / "include" / header.name).exists():
            shutil.move(str(header), home / "include" / header.name)
    for lib in (cu13 / "lib").iterdir():
        target = home / "lib64" / lib.name
        if not target.exists():
            shutil.move(str(lib), target)
        # The unversioned name the linker looks for (-lcublas), as a toolkit ships it.
        plain = re.sub(r"\.so\.[\d.]+$", ".so", lib.name)
        if plain != lib.name and not (home / "lib64" / plain).exists():
            (home / "lib64" / plain).symlink_to(lib.name)
    stubs = home / "lib64" / "stubs"
    stubs.mkdir(exist_ok=True)
    make_stub(home / "include" / "cuda.h", "cu", "libcuda.so.1", stubs / "libcuda.so")
    make_stub(home / "include" / "nvml.h", "nvml", "libnvidia-ml.so.1", stubs / "libnvidia-ml.so")
    return home


def base_cudnn(work: Path) -> tuple[Path, Path]:
    """The older cuDNN's libraries and headers (from NVIDIA's wheel of that release)."""
    target = work / "cudnn"
    subprocess.run(
        ["uv", "pip", "install", "--quiet", "--no-deps", "--target", str(target), BASE_CUDNN],
        check=True,
        timeout=1800,
    )
    return target / "nvidia" / "cudnn" / "lib", target / "nvidia" / "cudnn" / "include"


def standin_image(buildah: Buildah) -> str:
    """The stand-in base, committed into ``buildah``'s storage once per recipe; its name."""
    name = f"localhost/ngc-standin:{recipe_key()}"
    if buildah("images", "--quiet", name, check=False).returncode == 0:
        return name
    debian = commit_base_image(buildah)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        work = Path(tmp)
        home = cuda_home(work)
        libs, headers = base_cudnn(work)
        ctr = buildah("from", debian).stdout.strip()
        try:
            mount = Path(buildah("mount", ctr).stdout.strip())
            shutil.copytree(home, mount / "usr/local/cuda-13.0", symlinks=True)
            (mount / "usr/local/cuda").symlink_to("cuda-13.0")
            libdir = mount / "usr/lib/x86_64-linux-gnu"
            for lib in libs.iterdir():  # libcudnn*.so.9 -> versioned file, as the debs lay out
                versioned = f"{lib.name[: lib.name.index('.so')]}.so.9.14.0"
                (libdir / versioned).unlink(missing_ok=True)
                shutil.copy2(lib, libdir / versioned)
                (libdir / lib.name).unlink(missing_ok=True)
                (libdir / lib.name).symlink_to(versioned)
            incdir = mount / "usr/include/x86_64-linux-gnu"
            for header in headers.glob("cudnn*.h"):
                shutil.copy2(header, incdir / header.name.replace(".h", "_v9.h"))
            subprocess.run(["chroot", str(mount), "ldconfig"], check=True)
            env = [f"{k}={v}" for k, v in NGC_ENV.items()]
            buildah("config", *(a for e in env for a in ("--env", e)), ctr)
            buildah("umount", ctr)
            buildah("commit", "--quiet", ctr, name)
        finally:
            buildah("rm", ctr, check=False)
    return name
