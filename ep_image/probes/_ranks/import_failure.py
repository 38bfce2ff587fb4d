"""Why the backend process failed while it imported: said by where the error was raised.

Why this module exists: an error in the import step used to get one fix, "the probe's own
imports failed in this python", whatever raised it. A ``--backend-class`` file that raises at
import, or a module loaded from outside the venv (a ``torch`` on PYTHONPATH shadowing the venv's)
needs another fix; the traceback's frames, recorded by the backend process when it failed
(``_supervise``), say which. The same frames name what was loaded from outside the venv, which
the report's ``loaded_outside_venv`` (read in the supervisor, which never imported it) missed.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from ep_image.probes import _venv_record
from ep_image.probes._ranks.types import RunOptions


def outside_frames(failure: dict[str, Any]) -> list[str]:
    """The files of the failure's traceback that lie outside the venv, its interpreter's
    standard library and ep_image (innermost last)."""
    files = [f for f in failure.get("error_frames") or [] if isinstance(f, str)]
    return _venv_record.outside_venv(files)


def _backend_class_file(spec: str | None) -> str | None:
    """The file ``--backend-class`` names (``FILE.py:Class``, or a module's file)."""
    if not spec:
        return None
    target = spec.rpartition(":")[0]
    if target.endswith(".py") or "/" in target:
        return os.path.realpath(target)
    try:
        found = importlib.util.find_spec(target)
    except (ImportError, ValueError):  # a parent package that does not import
        return None
    return os.path.realpath(found.origin) if found and found.origin else None


def _named_outside(failure: dict[str, Any], own_progress: dict[str, Any]) -> str | None:
    """The file of a module the error names (``No module named 'torch.distributed'``: torch)
    that the backend process had loaded from outside the venv, if any."""
    error = str(failure.get("error") or "")
    loaded = (own_progress.get("loaded_outside_venv") or {}).get("modules") or []
    for entry in loaded:
        name, _, file = str(entry).partition(": ")
        top = name.split(".")[0]
        if top and (f"'{top}'" in error or f"'{top}." in error or f" {top}." in error):
            return file
    return None


def hint(failure: dict[str, Any], options: RunOptions, own_progress: dict[str, Any]) -> str | None:
    """The fix for a failure in the import step when where it was raised (or what the error
    names, loaded from outside the venv) tells more than the probe's own imports failing; None
    otherwise."""
    frames = [os.path.realpath(f) for f in failure.get("error_frames") or [] if isinstance(f, str)]
    mine = _backend_class_file(options.backend_class)
    if mine is not None and mine in frames:
        return (
            f"--backend-class {options.backend_class}: its file {mine} raised while it was "
            "loaded (the error above): fix that file, or load another class"
        )
    outside = outside_frames(failure)
    named = _named_outside(failure, own_progress)
    if outside:  # where it was raised: the innermost such frame
        return _venv_record.shadowing_hint(outside[-1])
    if named:
        return _venv_record.shadowing_hint(named, raised=False)
    return None


def environment(own_progress: dict[str, Any], failure: dict[str, Any]) -> dict[str, Any]:
    """The report's ``environment``, with what the backend process had loaded from outside the
    venv when it failed (its own list, and the frames of the failure) added to what this
    process loaded."""
    facts = _venv_record.environment_facts()
    loaded = facts["loaded_outside_venv"]
    child = own_progress.get("loaded_outside_venv") or {}
    for key in ("shared_objects", "modules"):
        for item in child.get(key) or []:
            if item not in loaded[key]:
                loaded[key].append(item)
    for file in outside_frames(failure):
        item = f"(raised while imported): {file}"
        if not any(file in m for m in loaded["modules"]):
            loaded["modules"].append(item)
    loaded["modules"].sort()
    return facts
