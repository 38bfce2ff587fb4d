"""What is installed, found without importing it: a distribution's version, its PEP 610
``direct_url.json`` and the git commit it was built from, the distributions that ship a module,
a module's directory, a compiled extension's file and what that file holds, a build-info
module's literals.

Why: importing ``deep_ep`` can abort the process (DeepEP v2), and importing a backend to ask
what it is would load what the report is about; absent is ``None``, never an exception. See
docs/probes.md, section "check-env".
"""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import importlib.util
import json
import re
from pathlib import Path
from typing import Any


def dist_version(*names: str) -> tuple[str, str] | None:
    """``(name, version)`` of the first installed distribution among ``names``, else None."""
    for name in names:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def dist_direct_url(name: str) -> dict[str, Any] | None:
    """The PEP 610 ``direct_url.json`` of a distribution (git or local installs), if any."""
    try:
        text = metadata.distribution(name).read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


_LOCAL_SHA = re.compile(r"\+(?:g|git)?([0-9a-f]{7,40})(?:[._-].*)?$")


def commit_of(version: str | None, direct_url: dict[str, Any] | None) -> str | None:
    """The git commit a distribution was built from.

    A DeepEP built from git records it twice: its version carries ``+<shortsha>`` (setup.py
    appends ``git rev-parse --short HEAD``), and pip/uv write the full commit to
    ``direct_url.json``. The full one wins.
    """
    if direct_url:
        commit = (direct_url.get("vcs_info") or {}).get("commit_id")
        if commit:
            return str(commit)
    if version:
        match = _LOCAL_SHA.search(version)
        if match:
            return match.group(1)
    return None


def module_dir(name: str) -> Path | None:
    """Directory of a top-level package, found without importing it (None if absent)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(spec.origin).parent if spec.origin else None


def extension_path(name: str) -> str | None:
    """File of a top-level compiled extension module (``deep_ep_cpp``), found without loading."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None and spec.origin else None


def static_cxx_runtime(path: str) -> bool:
    """Whether a C++ extension carries its own copy of libstdc++ instead of linking the shared one.

    Such a build (a compiler wrapper adding ``-static-libstdc++`` made one on the GPU machine
    here) puts a second C++ runtime into a process where torch already loaded the shared
    one; HybridEP built that way died with SIGSEGV in iostream code inside its buffer
    constructor. The sign: ``std::`` symbols in the file, but no ``libstdc++.so.6`` among
    the libraries it asks the loader for.
    """
    return file_contains(path, b"_ZNSt") and not file_contains(path, b"libstdc++.so.6")


def file_contains(path: str, needle: bytes, chunk: int = 1 << 22) -> bool:
    """Whether the file at ``path`` contains ``needle`` (read in chunks; False if unreadable)."""
    try:
        with open(path, "rb") as fh:
            keep = len(needle) - 1  # bytes of a needle that may straddle the next read
            tail = b""
            while block := fh.read(chunk):
                window = tail + block
                if needle in window:
                    return True
                tail = window[-keep:] if keep else b""
    except OSError:
        return False
    return False


def providers_of(module: str) -> list[str]:
    """Distributions that install the top-level module ``module`` (from their RECORD files)."""
    try:
        mapping = metadata.packages_distributions()
    except Exception:
        return []
    return sorted(set(mapping.get(module, [])))


def read_literal_assignments(path: Path) -> dict[str, Any]:
    """Module-level ``NAME = <literal>`` assignments of a Python file, without executing it.

    Used for build-info modules such as sgl-deep-ep's ``deep_ep/_build_info.py``: importing
    it would import ``deep_ep`` itself.
    """
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return {}
    values: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                try:
                    values[target.id] = ast.literal_eval(node.value)
                except ValueError:
                    continue
    return values
