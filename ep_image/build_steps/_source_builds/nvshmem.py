"""The NVSHMEM set-up of DeepEP's source builds (v1, HybridEP), for host mode and image alike.

Without NVSHMEM_DIR, setup.py links the NVSHMEM of uv's temporary build environment, gone after
the build: ``build_environment`` points it at the venv's own with an ``$ORIGIN`` runpath (the
absolute entry setup.py adds dies when the venv is renamed) and, with CUDA 13, puts
``include/cccl`` on CPATH (NVSHMEM's headers need libcu++, which g++ does not find by itself);
``check_extension`` checks the result. Standard library only. See docs/image.md, section "The
DeepEP source builds and their NVSHMEM".
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

from ep_image.build_steps._venv.layout import VenvError, site_packages
from ep_image.native import elf
from ep_image.native.elf import Dynamic

DISTRIBUTION = "nvidia-nvshmem-cu13"
RUNPATH = "$ORIGIN/nvidia/nvshmem/lib"
HOST_LIB = "libnvshmem_host.so"
EXTENSION_GLOB = "deep_ep_cpp*.so"


class NvshmemError(RuntimeError):
    """The NVSHMEM set-up or the built extension is wrong; the message names the fix."""


def _site_packages(venv: Path) -> Path:
    """The venv's one lib/pythonX.Y/site-packages, its absence an NvshmemError."""
    try:
        return site_packages(venv)
    except VenvError as exc:
        raise NvshmemError(str(exc)) from None


def nvshmem_dir(venv: Path) -> Path:
    """``site-packages/nvidia/nvshmem`` of the venv, checked to hold the host library."""
    root = _site_packages(venv) / "nvidia" / "nvshmem"
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
    """The extension's dynamic section (ep_image/native/elf.py), errors as NvshmemError."""
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
    site = _site_packages(venv)
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
            "python3 -m ep_image.build_steps.make_venv's NVSHMEM set-up and kept in its cache. "
            "Fix: `uv cache clean deep-ep`, then rebuild with "
            "python3 -m ep_image.build_steps.make_venv."
        )
    return asdict(
        ExtensionCheck(extension.name, needed, dynamic.runpath, str(target.relative_to(site)))
    )
