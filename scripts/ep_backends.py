"""The expert-parallel (EP) backend registry: one place that names the backends.

Why this module exists: the three backends (DeepEP v1, DeepEP v2, HybridEP) all ship the
Python module ``deep_ep``, so a venv may hold exactly one of them, chosen through a uv extra
of the same name. Scripts, probes and the Dockerfile must agree on those names and on how to
tell the backends apart once installed, without copying any pin: versions and git commits are
read from ``pyproject.toml`` (the one source of truth), never repeated here.

What is *not* a pin and therefore lives here: the backend names, the distribution that carries
each backend's ``deep_ep``, and a marker file inside ``deep_ep`` that only that backend's
layout has (v1: ``deep_ep/buffer.py``; v2: ``deep_ep/buffers/elastic.py``; HybridEP:
``deep_ep/hybrid_ep_buffer.py``). ``load_registry`` checks these against ``pyproject.toml``
so a renamed extra or distribution fails loudly instead of drifting.

Run it to see the registry: ``python scripts/ep_backends.py [--json] [--project DIR]``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tomllib
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

#: Backend names, in the order scripts build and list them. Each is also the uv extra's name.
BACKEND_NAMES: tuple[str, ...] = ("deepep_v1", "deepep_v2", "hybridep")

#: Selects every backend where a caller accepts several (host mode, dedup of a prefix).
ALL = "all"

#: The distribution that installs ``deep_ep`` for each backend (identity, not a pin).
_DISTRIBUTIONS: dict[str, str] = {
    "deepep_v1": "tokenspeed-deepep",
    "deepep_v2": "sgl-deep-ep",
    "hybridep": "deep-ep",
}

#: A file, relative to site-packages, that only this backend's ``deep_ep`` layout ships.
_MARKER_FILES: dict[str, str] = {
    "deepep_v1": "deep_ep/buffer.py",
    "deepep_v2": "deep_ep/buffers/elastic.py",
    "hybridep": "deep_ep/hybrid_ep_buffer.py",
}

#: The Python module every backend ships (why they conflict).
MODULE = "deep_ep"

DEFAULT_PROJECT = Path(__file__).resolve().parent.parent


class UnknownBackendError(ValueError):
    """A backend name that is not in the registry; the message lists the valid ones."""


class RegistryError(RuntimeError):
    """pyproject.toml and this registry disagree (an extra or distribution was renamed)."""


@dataclass(frozen=True)
class Backend:
    """One EP backend as the build needs it.

    ``requirements`` and ``git`` come from pyproject.toml, so they always match the lock.
    """

    name: str
    extra: str
    distribution: str
    marker_file: str
    requirements: tuple[str, ...]
    requirement: str
    git: str | None
    git_rev: str | None

    @property
    def source_label(self) -> str:
        """Where the backend's distribution comes from, for messages."""
        if self.git:
            return f"{self.git}@{self.git_rev}" if self.git_rev else self.git
        return "PyPI"


def normalize(name: str) -> str:
    """PEP 503 normalization, the form uv uses for distribution and extra names."""
    return re.sub(r"[-_.]+", "-", name).lower()


def valid_names_text() -> str:
    """The valid backend names as one line, for error messages and --help."""
    return ", ".join(BACKEND_NAMES)


def validate_backend(name: str) -> str:
    """Return ``name`` if it is a backend, else raise UnknownBackendError listing valid names."""
    if name in BACKEND_NAMES:
        return name
    raise UnknownBackendError(
        f"unknown EP backend {name!r}; valid backends: {valid_names_text()} "
        f"(or {ALL!r} where several are accepted)"
    )


def expand_backends(names: Iterable[str]) -> list[str]:
    """Validate ``names`` and expand ``all``; keeps registry order and drops repeats.

    Accepts comma-separated items too (``deepep_v1,deepep_v2``), as build args pass them.
    """
    wanted: set[str] = set()
    for item in names:
        for part in filter(None, (p.strip() for p in item.split(","))):
            if part == ALL:
                wanted.update(BACKEND_NAMES)
            else:
                wanted.add(validate_backend(part))
    if not wanted:
        raise UnknownBackendError(f"no EP backend given; valid backends: {valid_names_text()}")
    return [name for name in BACKEND_NAMES if name in wanted]


def read_pyproject(project: Path = DEFAULT_PROJECT) -> dict:
    """Parse ``<project>/pyproject.toml``; the error names the flag that points elsewhere."""
    path = project / "pyproject.toml"
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise RegistryError(
            f"{path} not found: pass --project DIR, the directory that holds pyproject.toml "
            "and uv.lock"
        ) from None


def _requirement_for(extra_reqs: list[str], distribution: str) -> str:
    """The requirement string in ``extra_reqs`` that names ``distribution``."""
    pattern = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
    for req in extra_reqs:
        match = pattern.match(req)
        if match and normalize(match.group(1)) == normalize(distribution):
            return req.strip()
    raise RegistryError(
        f"distribution {distribution!r} is not in the extra's requirements {extra_reqs}; "
        "update _DISTRIBUTIONS in scripts/ep_backends.py to match pyproject.toml"
    )


def _git_source(pyproject: dict, distribution: str) -> tuple[str | None, str | None]:
    """The git URL and rev of ``distribution`` in ``[tool.uv.sources]``, if it has one."""
    sources = pyproject.get("tool", {}).get("uv", {}).get("sources", {})
    for key, value in sources.items():
        if normalize(key) != normalize(distribution):
            continue
        entries = value if isinstance(value, list) else [value]
        for entry in entries:
            if "git" in entry:
                rev = entry.get("rev") or entry.get("tag") or entry.get("branch")
                return entry["git"], rev
    return None, None


def load_registry(project: Path = DEFAULT_PROJECT) -> dict[str, Backend]:
    """Every backend, with its requirements and source read from pyproject.toml."""
    pyproject = read_pyproject(project)
    extras = pyproject.get("project", {}).get("optional-dependencies", {})
    registry: dict[str, Backend] = {}
    for name in BACKEND_NAMES:
        if name not in extras:
            raise RegistryError(
                f"pyproject.toml has no extra {name!r} under [project.optional-dependencies]; "
                f"the registry expects extras {valid_names_text()}"
            )
        reqs = [str(r) for r in extras[name]]
        distribution = _DISTRIBUTIONS[name]
        git, rev = _git_source(pyproject, distribution)
        registry[name] = Backend(
            name=name,
            extra=name,
            distribution=distribution,
            marker_file=_MARKER_FILES[name],
            requirements=tuple(reqs),
            requirement=_requirement_for(reqs, distribution),
            git=git,
            git_rev=rev,
        )
    return registry


def get_backend(name: str, project: Path = DEFAULT_PROJECT) -> Backend:
    """One backend by name (validated), read from ``project``'s pyproject.toml."""
    return load_registry(project)[validate_backend(name)]


def other_distributions(name: str) -> list[str]:
    """The distributions of every backend except ``name``: none may share its venv."""
    validate_backend(name)
    return [dist for backend, dist in _DISTRIBUTIONS.items() if backend != name]


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=(
            "Print the EP backend registry: each backend's uv extra, the distribution that "
            "ships its `deep_ep` module, the marker file that identifies its layout, and its "
            "requirement and source as pyproject.toml pins them."
        ),
        epilog=f"Backends: {valid_names_text()}.",
    )
    parser.add_argument(
        "--project",
        type=Path,
        default=DEFAULT_PROJECT,
        help="directory holding pyproject.toml (default: this repository)",
    )
    parser.add_argument("--json", action="store_true", help="print the registry as JSON")
    parser.add_argument(
        "--names", action="store_true", help="print only the backend names, one a line"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.names:
        print("\n".join(BACKEND_NAMES))
        return 0
    try:
        registry = load_registry(args.project)
    except RegistryError as exc:
        print(f"ep_backends: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({n: asdict(b) for n, b in registry.items()}, indent=2))
        return 0
    for backend in registry.values():
        print(
            f"{backend.name:10} extra={backend.extra} dist={backend.distribution} "
            f"req={backend.requirement!r} source={backend.source_label} "
            f"marker={backend.marker_file}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
