"""Pins read from pyproject.toml and uv.lock: a git source's URL and commit, a locked version.

Why: every version, git URL and commit is pinned once, in pyproject.toml and uv.lock. The
registry and the build steps (make_venv, build_te, the image's stages) read them here instead of
repeating them or parsing the files with inline snippets of their own. Standard library only.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any


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
