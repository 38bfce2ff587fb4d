"""What a built venv must pass before it moves into place: its own backend, the ABI check.

Why: a venv that installs cleanly but fails at import on every GPU node is refused here.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from ep_image import backends as ep_backends
from ep_image.build_steps._uv.run import BuildError
from ep_image.build_steps._venv import dist_records
from ep_image.build_steps._venv.layout import site_packages
from ep_image.native import abi


def verify_backend(
    venv: Path, backend: ep_backends.Backend, installed: list[dict[str, str]]
) -> bool:
    """Check the backend's module landed and no other backend's did; True if installed."""
    names = {ep_backends.normalize(d["name"]) for d in installed}
    own = ep_backends.normalize(backend.distribution)  # a variant's own, when one is built
    others = [
        d
        for d in ep_backends.other_distributions(backend.name)
        if ep_backends.normalize(d) in names and ep_backends.normalize(d) != own
    ]
    if others:
        raise BuildError(f"{backend.name}: other backends' distributions installed: {others}")
    if own not in names:
        return False
    site = site_packages(venv)
    marker = site / backend.marker_file
    module = ep_backends.spec(backend.name).module
    layout = ep_backends.layout_backend(site / module.replace(".", "/"), module)
    if not marker.is_file() or layout != backend.name:
        raise BuildError(
            f"{backend.name}: {backend.distribution} is installed but its {module} is "
            f"{f'the {layout} layout' if layout else 'no known layout'}, not {backend.name}'s "
            f"({backend.marker_file}): check the pin in pyproject.toml"
        )
    return True


def check_files(venv: Path, distributions: list[str] | None = None) -> None:
    """BuildError unless every installed file (of ``distributions``, else of all) is byte for
    byte what its RECORD says: a truncated file in uv's cache installs cleanly and fails only
    at import (ep_image/build_steps/_venv/dist_records.py)."""
    problems = dist_records.verify(site_packages(venv), distributions)
    if problems:
        raise BuildError(
            f"{len(problems)} installed file(s) are not what their distribution recorded: "
            f"{dist_records.summary(problems)}. The venv would not import them. Fix: "
            "`uv cache clean` those distributions (a damaged cache entry), then build again"
        )


def check_imports(venv: Path, modules: list[str]) -> None:
    """BuildError unless the venv's python imports ``modules`` (no GPU needed for them)."""
    code = "; ".join(f"import {m}" for m in modules)
    proc = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise BuildError(
            f"the venv's python cannot import {', '.join(modules)}: {last}. Fix: see the error "
            "above; a damaged uv cache entry is the usual cause (`uv cache clean`, then build "
            "again)"
        )


def check_abi(venv: Path, distributions: list[str], strict: bool) -> list[dict[str, object]]:
    """Bind every compiled extension of ``distributions`` to the venv's own torch, NCCL, ...
    (ep_image/native/abi.py); a BuildError names the first symbol that does not bind and the fix.
    ``strict``: a library not found fails too (off for a venv that leaves packages out).

    Why here: a venv whose backend was built against another torch installs cleanly and fails
    at import on every GPU node; this refuses it before it is moved into place.
    """
    site = site_packages(venv)
    try:
        results = abi.check(site, venv / "bin" / "python", distributions)
    except abi.loader.LoaderError as exc:
        raise BuildError(f"the ABI check could not run: {exc}") from None
    version = abi.torch_version(site)
    problems = [line for r in results for line in r.problems(version, strict)]
    for result in results:
        ext = Path(result.extension).name
        state = "ok" if result.ok else "FAILS"
        notes = {
            "stub": ["driver symbols against the CUDA toolkit's stub"],
            "absent": ["driver symbols not checked (no driver or toolkit stub here)"],
        }.get(result.driver, [])
        if not result.complete:
            notes.append(f"not found, so not checked: {', '.join(result.not_found)}")
        detail = f" ({'; '.join(notes)})" if notes else ""
        print(f"make_venv: ABI {state}: {ext} binds to this venv's libraries{detail}", flush=True)
    if problems:
        raise BuildError("\n  - ".join(["the venv would not import:", *problems]))
    # Paths inside the venv relative to it: it is built under a temporary name and renamed.
    return [_relative_to(r.to_json(), venv) for r in results]


def _relative_to(data: dict[str, object], venv: Path) -> dict[str, object]:
    """``data`` with every path inside ``venv`` given relative to it."""

    def rel(path: object) -> object:
        if isinstance(path, str) and path.startswith(f"{venv}/"):
            return os.path.relpath(path, venv)
        return path

    data["extension"] = rel(data["extension"])
    unresolved = data.get("unresolved")
    if isinstance(unresolved, list):
        for entry in unresolved:
            entry["needed_by"] = rel(entry["needed_by"])
    return data
