"""HybridEP's NVSHMEM build set-up: one code path, run by host mode and by the image alike.

Why: HybridEP (DeepEP's hybrid-ep branch) compiles ``deep_ep_cpp`` against NVSHMEM. Its
setup.py links ``libnvshmem_host.so`` from ``$NVSHMEM_DIR/lib`` and records
``-rpath $NVSHMEM_DIR/lib``; without NVSHMEM_DIR it takes the ``nvidia.nvshmem`` module of uv's
isolated build environment, a temporary directory, so the extension then names a path that is
gone when the build ends (it loads only if something else loaded NVSHMEM first). Host mode did
exactly that while the image had its own fix-up; this module is the one fix both now run,
through ep_image/build/make_venv.py (``BackendSpec.build_needs`` holds ``nvshmem``):

1. make_venv syncs everything except the backend's own distribution, so the venv holds the
   lock's nvidia-nvshmem-cu13;
2. ``build_environment(venv)`` adds the unversioned ``libnvshmem_host.so`` link the wheel lacks
   and returns NVSHMEM_DIR (that directory, inside the venv) and LDFLAGS with the runpath
   ``$ORIGIN/nvidia/nvshmem/lib``: the extension sits at the top of site-packages, so it finds
   the venv's own NVSHMEM relative to itself however the venv is renamed, copied or mounted.
   With CUDA 13 it also puts ``$CUDA_HOME/include/cccl`` on CPATH: NVSHMEM's host headers
   include libcu++ (``cuda/std/tuple``), which CUDA 13 keeps there, a directory nvcc adds by
   itself but the C++ compiler building the extension's ``.cpp`` files does not (seen: the
   HybridEP build stopped at ``deep_ep.cpp`` without it);
3. make_venv syncs the backend with that environment, then ``check_extension(venv)`` reads the
   built extension's dynamic section and fails unless that runpath and the NVSHMEM library it
   needs are there (a wheel uv reused from its cache, built without this set-up, is caught).

The absolute NVSHMEM_DIR entry setup.py adds to the runpath points at the venv's temporary
build name and is dead once the venv is renamed; the ``$ORIGIN`` entry after it is the one the
loader uses. Standard library only.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

from ep_image import elf, project
from ep_image.elf import Dynamic

DISTRIBUTION = "nvidia-nvshmem-cu13"
RUNPATH = "$ORIGIN/nvidia/nvshmem/lib"
HOST_LIB = "libnvshmem_host.so"
EXTENSION_GLOB = "deep_ep_cpp*.so"


class NvshmemError(RuntimeError):
    """The NVSHMEM set-up or the built extension is wrong; the message names the fix."""


def site_packages(venv: Path) -> Path:
    """The venv's one lib/pythonX.Y/site-packages."""
    try:
        return project.site_packages(venv)
    except project.VenvError as exc:
        raise NvshmemError(str(exc)) from None


def nvshmem_dir(venv: Path) -> Path:
    """``site-packages/nvidia/nvshmem`` of the venv, checked to hold the host library."""
    root = site_packages(venv) / "nvidia" / "nvshmem"
    if not sorted((root / "lib").glob(f"{HOST_LIB}.*")):
        raise NvshmemError(
            f"{venv} has no {DISTRIBUTION} ({root}/lib/{HOST_LIB}.* missing), which the backend's "
            f"source build links against. Fix: keep {DISTRIBUTION} in the venv (do not list it "
            "in VENV_SKIP_PACKAGES / --no-install-package; the backend's extra pins it)."
        )
    return root


def build_environment(venv: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """NVSHMEM_DIR and LDFLAGS for the backend's source build, pointing at the venv's NVSHMEM.

    Adds ``lib/libnvshmem_host.so`` -> the versioned library (setup.py links the unversioned
    name when NVSHMEM_DIR is set; the wheel ships only the versioned one).
    """
    root = nvshmem_dir(venv)
    versioned = sorted((root / "lib").glob(f"{HOST_LIB}.*"))[-1]
    link = root / "lib" / HOST_LIB
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(versioned.name)
    env = dict(os.environ if base is None else base)
    ldflags = " ".join(filter(None, [env.get("LDFLAGS", ""), f"-Wl,-rpath,{RUNPATH}"]))
    result = {"NVSHMEM_DIR": str(root), "LDFLAGS": ldflags}
    cccl = Path(env.get("CUDA_HOME") or "/usr/local/cuda") / "include" / "cccl"
    if cccl.is_dir():
        result["CPATH"] = os.pathsep.join(filter(None, [str(cccl), env.get("CPATH", "")]))
    return result


# --- reading the built extension --------------------------------------------------------------


def read_dynamic(path: Path) -> Dynamic:
    """The extension's dynamic section (ep_image/elf.py), errors as NvshmemError."""
    try:
        return elf.read_dynamic(path)
    except (OSError, elf.ElfError) as exc:
        raise NvshmemError(str(exc)) from None


@dataclass(frozen=True)
class ExtensionCheck:
    """What check_extension found, for ep-backend.json."""

    extension: str
    needed: str
    runpath: tuple[str, ...]
    resolves_to: str


def check_extension(venv: Path) -> dict[str, object]:
    """Fail unless the backend's extension finds the venv's NVSHMEM through ``$ORIGIN``."""
    site = site_packages(venv)
    extensions = sorted(site.glob(EXTENSION_GLOB))
    if not extensions:
        raise NvshmemError(
            f"no {EXTENSION_GLOB} in {site}: the backend was built without its NVSHMEM "
            "extension. Check the build output above (NVSHMEM_DIR, nvcc)."
        )
    extension = extensions[0]
    dynamic = read_dynamic(extension)
    needed = next((n for n in dynamic.needed if n.startswith(HOST_LIB)), None)
    if needed is None:
        raise NvshmemError(
            f"{extension.name} does not link {HOST_LIB}: it was built without NVSHMEM "
            f"(needs: {', '.join(dynamic.needed)})"
        )
    target = site / "nvidia" / "nvshmem" / "lib" / needed
    if RUNPATH not in dynamic.runpath or not target.exists():
        raise NvshmemError(
            f"{extension.name} has runpath {':'.join(dynamic.runpath) or '(none)'}, without "
            f"{RUNPATH} (or {target} is missing): it would look for {needed} in a directory "
            "that does not outlive the build. This is a wheel uv built without "
            "python3 -m ep_image.build.make_venv's NVSHMEM set-up and kept in its cache. Fix: "
            "`uv cache clean deep-ep`, then rebuild with python3 -m ep_image.build.make_venv."
        )
    return asdict(
        ExtensionCheck(extension.name, needed, dynamic.runpath, str(target.relative_to(site)))
    )
