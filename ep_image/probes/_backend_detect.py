"""Which EP backend this environment holds, found without importing it.

Why this module exists: DeepEP v1, DeepEP v2 and HybridEP all install the module ``deep_ep``,
and importing DeepEP v2 runs checks that can end the process (a second libnccl, an NCCL older
than 2.30); NCCL EP installs ``nccl.ep``, whose native library needs the GPU driver. So the
probes first ask package metadata and the file layout what is installed, and only then decide
whether, and how carefully, to import it. It also turns a failed import into a verdict that
names the fix.

Identity rules (distribution first, file layout to confirm or decide): the facts, which module,
distribution and marker file stands for which backend, live in the backend registry
(``ep_image/backends/``: ``modules()``, ``PROVIDERS`` and ``layout_markers()``); the detection
logic that applies them is here. A git build of DeepEP (``deep-ep``) is told apart by its layout
only.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from ep_image import backends as registry
from ep_image.native import abi
from ep_image.probes import _installed, _venv_record
from ep_image.probes._report import Status, one_line

MODULE = registry.MODULE
BACKEND_NAMES: tuple[str, ...] = registry.BACKEND_NAMES
REFERENCE_BACKEND = "torch"

#: (backend, file inside the ``deep_ep`` package that only its layout has), in the order to test
#: them (the hybrid-ep branch also ships v1's ``buffer.py``).
MARKERS: tuple[tuple[str, str], ...] = registry.layout_markers()

#: Distributions known to carry ``deep_ep``, for reporting and identification (``deep_ep`` is
#: the spelling some builds register under).
KNOWN_DISTRIBUTIONS: tuple[str, ...] = (*registry.known_distributions(MODULE), "deep_ep")

#: How a user gets each backend, for "missing" messages.
INSTALL_HINTS: dict[str, str] = {name: registry.install_hint(name) for name in BACKEND_NAMES}


@dataclasses.dataclass
class Installed:
    """What provides a backend's module here. ``backend`` is None when nothing (known) does."""

    backend: str | None
    module_dir: str | None
    distribution: str | None
    version: str | None
    commit: str | None
    reason: str
    build_info: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: The source repository the build came from, where it can be known.
    upstream: str | None = None
    #: Why ``commit`` is what it is ("git build, direct_url.json", or why it is unknown).
    commit_source: str = ""
    #: The Python module found (``deep_ep``, ``nccl.ep``): what the import step imports.
    module: str = MODULE

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: What a prebuilt wheel says of its origin (the registry's providers); none of them records the
#: commit it was built from.
WHEEL_PROVENANCE: dict[str, tuple[str | None, str]] = {
    registry.normalize(p.distribution): (p.upstream, p.no_commit)
    for p in reversed(registry.PROVIDERS)
    if p.no_commit
}


def provenance(
    dist_name: str | None, version: str | None, direct_url: dict[str, Any] | None
) -> tuple[str | None, str | None, str]:
    """(upstream repository, commit, how the commit is known or why it is not)."""
    commit = _installed.commit_of(version, direct_url)
    url = (direct_url or {}).get("url")
    vcs = (direct_url or {}).get("vcs_info") or {}
    if vcs.get("commit_id"):
        return url, commit, "git build: direct_url.json"
    if commit:
        return url, commit, f"git build: the +<sha> of version {version}"
    norm = (dist_name or "").lower().replace("_", "-")
    if norm in WHEEL_PROVENANCE:
        upstream, why = WHEEL_PROVENANCE[norm]
        return upstream, None, why
    if version and version.endswith("+local"):
        return url, None, "unknown: built from a source tree without git metadata (+local)"
    return url, None, "unknown: neither direct_url.json nor the version records a commit"


def backend_from_layout(package_dir: Path, module: str = MODULE) -> str | None:
    """The backend whose marker file ``package_dir`` (a ``module`` directory) contains."""
    return registry.layout_backend(package_dir, module)


def backend_from_distribution(name: str, version: str) -> str | None:
    """The backend a distribution name and version stand for, where the name alone tells."""
    return registry.backend_of_distribution(name, version)


def _distribution_of(module: str) -> tuple[str | None, str | None]:
    """The installed distribution that provides ``module`` and its version."""
    known = registry.known_distributions(module)
    # deep_ep: a distribution whose RECORD lists it (some builds register as "deep_ep"), else
    # any known name that is installed. A dotted module shares its top level (nccl4py owns
    # nccl.core beside nccl.ep), so only the known names tell.
    names = [*_installed.providers_of(module), *KNOWN_DISTRIBUTIONS] if module == MODULE else known
    for name in names:
        found = _installed.dist_version(name)
        if found:
            return found
    return None, None


def detect_module(module: str = MODULE) -> Installed:
    """Identify the provider of ``module`` from metadata and layout; never imports it."""
    package_dir = _installed.module_dir(module)
    dist_name, version = _distribution_of(module)
    if package_dir is None:
        reason = f"no module named {module} on sys.path"
        if dist_name:
            reason += f" (distribution {dist_name} {version} is registered but its files are gone)"
        return Installed(None, None, dist_name, version, None, reason, module=module)

    markers = dict(registry.layout_markers(module))
    layout = backend_from_layout(package_dir, module)
    by_dist = backend_from_distribution(dist_name, version or "") if dist_name else None
    # A layout that also ships other backends' markers (the hybrid-ep branch) is not reported as
    # a mismatch: such builds are registered under several names.
    shadowing = bool(layout and registry.spec(layout).also_ships_markers_of)
    if layout and by_dist and layout != by_dist and not shadowing:
        reason = (
            f"{dist_name} {version} names {by_dist} but the files at {package_dir} have the "
            f"{layout} layout; going by the files"
        )
    elif layout:
        reason = f"{dist_name or 'unregistered files'} {version or ''}".strip()
        reason += f"; layout of {layout} ({markers[layout]})"
    elif by_dist:
        layout = by_dist
        reason = f"{dist_name} {version} (no known marker file in {package_dir})"
    else:
        reason = f"{module} at {package_dir} has no known layout (no {', '.join(markers.values())})"

    direct_url = _installed.dist_direct_url(dist_name) if dist_name else None
    upstream, commit, commit_source = provenance(dist_name, version, direct_url)
    build_info = _installed.read_literal_assignments(package_dir / "_build_info.py")
    return Installed(
        backend=layout,
        module_dir=str(package_dir),
        distribution=dist_name,
        version=version,
        commit=commit,
        reason=reason,
        build_info=build_info,
        upstream=upstream,
        commit_source=commit_source,
        module=module,
    )


def detect_installed(backend: str | None = None) -> Installed:
    """What provides ``backend``'s module here, or, without one, the backend to check: the only
    one installed; of several (backends that ship different modules may share an environment),
    the default one if installed, else the first in the registry's order, saying which others
    are there. Nothing installed: the ``deep_ep`` verdict (no module named deep_ep)."""
    if backend in BACKEND_NAMES:
        return detect_module(registry.spec(backend).module)
    found = [d for d in map(detect_module, registry.modules()) if d.module_dir is not None]
    if not found:
        return detect_module(MODULE)
    chosen = next((d for d in found if d.backend == registry.DEFAULT_BACKEND), found[0])
    others = [d for d in found if d is not chosen]
    if others:
        chosen.reason += "; also installed: " + ", ".join(
            f"{d.backend or 'an unknown ' + d.module} ({d.module})" for d in others
        )
    return chosen


@dataclasses.dataclass
class ImportTrial:
    """The outcome of importing a module in a throw-away child process."""

    ok: bool
    returncode: int
    output: str
    seconds_limit: float

    @property
    def signal_name(self) -> str | None:
        if self.returncode < 0:
            try:
                return signal.Signals(-self.returncode).name
            except ValueError:
                return f"signal {-self.returncode}"
        return None


def trial_import(module: str = MODULE, timeout: float = 600.0) -> ImportTrial:
    """Import ``module`` in a child Python so an import that aborts cannot take the probe down.

    DeepEP v2's import compares the loaded libnccl with the one it was linked against and
    may end the process; a child that dies is reported, not inherited.
    """
    code = (
        "import importlib, sys\n"
        f"m = importlib.import_module({module!r})\n"
        "print('imported', getattr(m, '__file__', None))\n"
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env=os.environ.copy(),
        )
    except subprocess.TimeoutExpired as exc:
        output = (exc.stdout or "") + (exc.stderr or "") if isinstance(exc.stdout, str) else ""
        return ImportTrial(
            False, 124, output + f"\n(import timed out after {timeout:.0f}s)", timeout
        )
    return ImportTrial(proc.returncode == 0, proc.returncode, proc.stdout + proc.stderr, timeout)


def last_error_line(output: str) -> str:
    """The most telling line of a failed import's output (the exception line, or the last)."""
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line or "error" in line or "undefined symbol" in line:
            return line
    return lines[-1] if lines else "(no output)"


NCCL_FIX = (
    "DeepEP v2 needs NCCL >= 2.30 loaded once: install nvidia-nccl-cu13>=2.30 (the `moe` "
    "extra pins 2.30.7) in this venv and make sure no other libnccl comes first "
    "(check LD_LIBRARY_PATH and LD_PRELOAD)"
)


#: Run-time errors of a backend that imported fine, by a phrase of their message, and the fix.
RUN_TIME_HINTS: tuple[tuple[str, str], ...] = (
    (
        "NCCL GIN is unavailable",
        "DeepEP v2 uses NCCL GIN (GPU-initiated networking) by default, even on one node, and "
        "NCCL found no RDMA NIC for it (NET/IB: no device). Within one node set "
        "EP_DISABLE_GIN=1 (DeepEP's switch: NVLink only; passes on an H200, "
        "docs/probe-results.md); across nodes run on InfiniBand/RoCE NICs with GPUDirect RDMA "
        "(check-fabric tells what is missing); or pick a backend that runs over "
        "NVLink alone: " + ", ".join(s.name for s in registry.SPECS if not s.needs_nccl_gin),
    ),
    (
        "Numpy is not available",
        "the backend's buffer swaps handles through torch.distributed.all_gather_object, which "
        "needs numpy, and this environment has none: install numpy in the backend's venv (the "
        "lock's backend extras hold it: rebuild the venv with python3 scripts/make_venv.py)",
    ),
    (
        "CPU recv timeout",
        "a rank never reached the matching kernel: check that every rank got its own GPU "
        "(or --ranks-per-gpu) and the same shape, and run the backend's own tests here",
    ),
)


def run_time_hint(detail: str) -> str:
    """The fix for a known run-time error message, or '' when none is known."""
    return next((hint for phrase, hint in RUN_TIME_HINTS if phrase in detail), "")


def undefined_symbol(output: str) -> str | None:
    """The symbol of the dynamic loader's "undefined symbol: NAME" in ``output``, if any."""
    marker = "undefined symbol: "
    at = output.find(marker)
    if at < 0:
        return None
    rest = output[at + len(marker) :].split()
    return rest[0].rstrip(",;)") if rest else None


#: A file a Python traceback names: ``  File "/path/x.py", line 3, in <module>``.
_TRACEBACK_FILE = re.compile(r'^\s*File "([^"]+)", line \d+', re.M)


def classify_import_failure(
    backend: str, output: str, returncode: int, gpu_visible: bool, module: str = MODULE
) -> tuple[Status, str, str]:
    """Turn a failed ``import <module>`` (``deep_ep``, ``nccl.ep``) into (status, one-line
    detail, fix).

    Known causes get a precise fix; an unknown failure on a machine without a GPU is a skip
    (5), since DeepEP builds need a GPU to load; anything else is "unusable" (3).
    """
    text = output
    last = one_line(last_error_line(output), 300)
    if returncode < 0:
        sig = ImportTrial(False, returncode, output, 0).signal_name
        detail = f"import {module} killed the process ({sig}); last output: {last}"
        hint = (
            "the import aborted the interpreter; with DeepEP v2 this is usually its NCCL "
            "check (two libnccl loaded, or a different one than it was linked against). " + NCCL_FIX
        )
        return Status.ERROR, detail, hint
    symbol = undefined_symbol(text)
    if symbol and abi.symbol_origin(symbol) == "torch":
        torch = (_installed.dist_version("torch") or ("torch", "unknown"))[1]
        return (
            Status.ERROR,
            f"import {module} failed: {last}",
            f"the backend's extension was built against another torch than this venv's torch "
            f"{torch} (it needs {symbol}, which this torch does not export): reinstalling the "
            "same build cannot help. Build it from source against this torch (scripts/"
            "make_venv.py does, and refuses such a venv: ep_image/native/abi.py), or install a "
            "build that declares this torch in its requirements",
        )
    if "ncclCommQueryProperties" in text or ("undefined symbol" in text and "nccl" in text.lower()):
        return Status.ERROR, f"import {module} failed: {last}", NCCL_FIX
    if "Duplicate NCCL runtime" in text or "Invalid NCCL versions" in text:
        return (
            Status.ERROR,
            f"import {module} failed: {last}",
            "two different libnccl are loaded: " + NCCL_FIX + "; EP_SUPPRESS_NCCL_CHECK=1 "
            "silences the check but not the mismatch",
        )
    if "undefined symbol" in text and "nvshmem" in text.lower():
        return (
            Status.ERROR,
            f"import {module} failed: {last}",
            "the extension was built against another NVSHMEM (or one without IBGDA): install "
            "the nvidia-nvshmem-cu13 version it was built with, or rebuild the backend",
        )
    if "requires CUDA" in text and "PyTorch uses CUDA" in text:
        return (
            Status.ERROR,
            f"import {module} failed: {last}",
            "the backend wheel and torch target different CUDA majors: install the torch "
            "build for the backend's CUDA (cu130 for the pinned wheels)",
        )
    if "No module named 'deep_ep_cpp'" in text or "No module named 'deep_ep._C'" in text:
        return (
            Status.ERROR,
            f"import {module} failed: {last}",
            "the compiled extension is missing: the backend build failed or targets another "
            f"Python; reinstall it ({INSTALL_HINTS.get(backend, 'reinstall the backend')})",
        )
    outside = _venv_record.outside_venv(_TRACEBACK_FILE.findall(text))
    if outside:  # code from outside the venv raised: not the backend's build, not the GPU
        return (
            Status.ERROR,
            f"import {module} failed in {outside[-1]}: {last}",
            _venv_record.shadowing_hint(outside[-1]),
        )
    if not gpu_visible:
        return (
            Status.SKIP,
            f"{module} is installed but does not load without a GPU: {last}",
            "no GPU visible: run on a GPU node or pass --backend torch",
        )
    if "assert cuda_home is not None" in text or "CUDA_HOME" in text:
        return (
            Status.ERROR,
            f"import {module} failed: {last}",
            "CUDA home not found: set CUDA_HOME to a CUDA 13 toolkit with nvcc; DeepEP v2 "
            "JIT-compiles its kernels at run time",
        )
    return (
        Status.ERROR,
        f"import {module} failed: {last}",
        f"read the error above; reinstall the backend ({INSTALL_HINTS.get(backend, '')})",
    )
