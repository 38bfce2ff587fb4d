"""Which backend a run checks: ``--backend`` (or ``--backend-class``) against what is installed.

Why this module exists: the answer comes before torch is imported, from package metadata and
the file layout alone (``_backend_detect``), so a backend that is requested but absent is
reported as missing in a second, and ``auto`` names what it found and why.
"""

from __future__ import annotations

from ep_image.probes import _backend_detect
from ep_image.probes._ranks.types import RunOptions, Selection
from ep_image.probes._report import Status, Step


def select_backend(options: RunOptions) -> Selection:
    """Resolve --backend against what is installed; a requested-but-absent one is MISSING."""
    if options.backend_class:
        return Selection("custom", f"--backend-class {options.backend_class}", None, custom=True)
    if options.backend == "torch":
        return Selection("torch", "requested", None)
    installed = _backend_detect.detect_installed(options.backend)
    if options.backend == "auto":
        if installed.module_dir is None:
            return Selection(
                "torch", "auto: no EP backend installed, using the torch reference", installed
            )
        if installed.backend is None:
            step = Step(
                "import",
                Status.ERROR,
                detail=f"auto: {installed.reason}",
                hint=f"install one of {', '.join(_backend_detect.BACKEND_NAMES)}, or pass "
                "--backend torch",
            )
            return Selection("unknown", "auto", installed, step)
        return Selection(installed.backend, f"auto: {installed.reason}", installed)
    if installed.backend == options.backend:
        return Selection(options.backend, f"requested; {installed.reason}", installed)
    if installed.module_dir is None:
        detail = f"{options.backend} requested but not installed: {installed.reason}"
    else:
        detail = (
            f"{options.backend} requested but this environment holds "
            f"{installed.backend or 'an unknown ' + installed.module} ({installed.reason})"
        )
    step = Step(
        "import", Status.MISSING, detail=detail, hint=_backend_detect.INSTALL_HINTS[options.backend]
    )
    return Selection(options.backend, "requested", installed, step)
