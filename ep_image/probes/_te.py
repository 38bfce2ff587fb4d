"""Transformer Engine as installed, without importing it: the names its distribution goes by, and
where build_te's ``te-build.json`` (what TE was built against) is found.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

DEFAULT_TE_BUILD_INFO = "/opt/venvs/te-build.json"
# Names under which a Transformer Engine install may be registered (source build or PyPI parts).
TE_DISTRIBUTIONS = (
    "transformer-engine",
    "transformer_engine",
    "transformer-engine-torch",
    "transformer-engine-cu13",
    "transformer-engine-cu12",
)


def te_build_info_candidates(prefix: str | None = None) -> list[str]:
    """Where a te-build.json is looked for when none is named: in the directory that holds this
    venv (``<prefix>/te-build.json``, where the image keeps it for its venvs), then the image's
    own path, for a Python outside ``/opt/venvs`` in the image."""
    beside = str(Path(prefix or sys.prefix).parent / "te-build.json")
    return list(dict.fromkeys([beside, DEFAULT_TE_BUILD_INFO]))


def te_build_info_path(flag: str | None = None, prefix: str | None = None) -> str | None:
    """Where build_te.py's te-build.json is: the flag, ``EP_TE_BUILD_INFO``, else the first of
    :func:`te_build_info_candidates` that exists; None when there is none."""
    named = flag or os.environ.get("EP_TE_BUILD_INFO")
    if named:
        return named
    return next((p for p in te_build_info_candidates(prefix) if Path(p).is_file()), None)


def no_te_build_info() -> str:
    """What to say where no te-build.json was named and none was found."""
    looked = ", ".join(te_build_info_candidates())
    return f"no te-build.json (looked at {looked}; --te-build-info or EP_TE_BUILD_INFO names one)"


def read_json_file(path: str) -> dict[str, Any] | None:
    """A JSON object from ``path``; None when the file is absent or not a JSON object."""
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None
