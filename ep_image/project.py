"""Pins read from pyproject.toml and uv.lock, and small file helpers the build scripts share.

Why: every version, git URL and commit is pinned once, in pyproject.toml and uv.lock. The build
steps (make_venv, build_te, the image's stages) read them here instead of repeating them or
parsing the files with inline snippets of their own.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import tomllib
from pathlib import Path
from typing import Any

from ep_image.record_path import RecordPathError, not_a_file

# A venv's record, written by ep_image.build_steps.make_venv and read by the image's steps: a
# finished backend venv, or (venvs-common) a skeleton without its backend's distribution.
VENV_RECORD = "ep-backend.json"
SKELETON_RECORD = "ep-skeleton.json"


class PinError(RuntimeError):
    """A pin the caller needs is not in pyproject.toml or uv.lock; the message says which."""


def normalize(name: str) -> str:
    """PEP 503 normalization, the form uv uses for distribution and extra names."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_toml(path: Path) -> dict[str, Any]:
    """Parse a TOML file; a missing file names the flag that points elsewhere."""
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise PinError(
            f"{path} not found: pass --project DIR, the directory that holds pyproject.toml "
            "and uv.lock"
        ) from None


def git_source(
    pyproject: dict[str, Any], distribution: str, extra: str | None = None
) -> tuple[str | None, str | None]:
    """The git URL and rev of ``distribution`` in ``[tool.uv.sources]``, if it has one; with
    ``extra``, the entry for that extra (uv's per-extra sources) or one that names none."""
    sources = pyproject.get("tool", {}).get("uv", {}).get("sources", {})
    for key, value in sources.items():
        if normalize(key) != normalize(distribution):
            continue
        entries = value if isinstance(value, list) else [value]
        for entry in entries:
            if extra is not None and entry.get("extra", extra) != extra:
                continue
            if "git" in entry:
                rev = entry.get("rev") or entry.get("tag") or entry.get("branch")
                return entry["git"], rev
    return None, None


def pinned_git(project: Path, distribution: str) -> tuple[str, str]:
    """(URL, commit) that pyproject.toml pins for a git-sourced distribution."""
    url, rev = git_source(read_toml(project / "pyproject.toml"), distribution)
    if not url or not rev:
        raise PinError(
            f"{project / 'pyproject.toml'} pins no git source for {distribution} in "
            "[tool.uv.sources] (expected { git = URL, rev = COMMIT })"
        )
    return url, rev


def locked_versions(project: Path, distribution: str) -> set[str]:
    """Every version uv.lock holds for ``distribution`` (several when extras fork it)."""
    lock = read_toml(project / "uv.lock")
    wanted = normalize(distribution)
    return {p["version"] for p in lock.get("package", []) if normalize(p["name"]) == wanted}


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in chunks."""
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def write_json(
    path: Path, data: Any, *, sort_keys: bool = True, default: Any = None, fsync: bool = False
) -> Path:
    """Write ``data`` as indented JSON atomically (temporary file in the same directory, then
    rename), world-readable, so a reader never sees half a record. ``fsync``: on disk before the
    rename (a probe's report must survive the machine going down). RecordPathError, before
    anything is written, when something other than a regular file is at ``path``."""
    path = Path(path)
    if (why := not_a_file(path)) is not None:
        raise RecordPathError(why, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # records are for others to read; mkstemp makes 0600
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(data, indent=2, sort_keys=sort_keys, default=default) + "\n")
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        if (why := not_a_file(path)) is not None:  # put there while this one was written
            raise RecordPathError(why, path)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


class VenvError(RuntimeError):
    """A directory that is not the venv the caller expected; the message says why."""


def site_packages(venv: Path) -> Path:
    """The venv's one ``lib/python3.X/site-packages``."""
    found = sorted(Path(venv).glob("lib/python3*/site-packages"))
    if len(found) != 1:
        raise VenvError(
            f"{venv}: expected one lib/python3*/site-packages, found {len(found)}: is it a venv? "
            "Create it with python3 -m ep_image.build_steps.make_venv or "
            "`uv sync --extra <backend>`."
        )
    return found[0]
