"""The expert-parallel (EP) backend registry: one module per backend, one place for each fact.

Each module here (``deepep_v1.py``, ...) declares its backend's ``SPEC`` (a backend with code of
its own is a package: ``hybridep/__init__.py``, beside its JIT cache; ``ncclep/__init__.py``,
beside what is read of its native library); this package collects them and answers every
question the build, the probes, the Dockerfile's generated stages and the workflows ask about
backends. Pins are not here: they are read from pyproject.toml. Adding a backend and what else
it touches: docs/architecture.md.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from ep_image.backends._spec import (
    INTERNODE_CHECKS,
    MODULE,
    NCCL,
    NVSHMEM,
    UPSTREAM_SHAPES,
    BackendSpec,
    Provider,
    Variant,
)
from ep_image.pins import PinError, git_source, normalize, read_toml

__all__ = [
    "ALL", "BACKEND_EXTRAS", "BACKEND_NAMES", "DEFAULT_BACKEND", "INTERNODE_CHECKS", "MODULE",
    "NCCL", "NVSHMEM", "PROVIDERS", "SPECS", "UPSTREAM_SHAPES", "Backend", "BackendSpec",
    "Provider", "RegistryError", "UnknownBackendError", "Variant",
]  # fmt: skip

#: Selects every backend where a caller accepts several (host mode, the image's EP).
ALL = "all"


def _discover() -> tuple[BackendSpec, ...]:
    """Every backend module's SPEC, in module-name order: that order is the registry's. A
    backend with code of its own beside its SPEC is a package (its ``__init__.py`` holds it)."""
    found_modules = sorted(
        (m.name, m.ispkg) for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")
    )
    names = [name for name, _ in found_modules]
    specs = tuple(importlib.import_module(f"{__name__}.{name}").SPEC for name in names)
    for (name, package), found in zip(found_modules, specs, strict=True):
        where = (
            f"ep_image/backends/{name}/__init__.py" if package else f"ep_image/backends/{name}.py"
        )
        if found.name != name or "-" in name:
            raise RuntimeError(f"{where}: SPEC.name must be the module's name, without '-'")
        if found.internode_check not in ("", *INTERNODE_CHECKS):
            raise RuntimeError(f"{where}: internode_check must be one of {INTERNODE_CHECKS}")
        if found.upstream_shape not in UPSTREAM_SHAPES:
            raise RuntimeError(f"{where}: upstream_shape must be one of {UPSTREAM_SHAPES}")
    if sum(s.default for s in specs) != 1:
        raise RuntimeError("exactly one backend module must say default=True")
    return specs


#: The backends, one module each (ep_image/backends/<name>.py, or <name>/__init__.py), in the
#: order scripts build and list them.
SPECS: tuple[BackendSpec, ...] = _discover()

#: The backend an image or host prefix makes active when nothing else is asked for, and the
#: image's default EP: the one module whose SPEC says ``default=True``. The `moe` extra of
#: pyproject.toml holds the same one (a test checks).
DEFAULT_BACKEND: str = next(s.name for s in SPECS if s.default)

BACKEND_NAMES: tuple[str, ...] = tuple(spec.name for spec in SPECS)
#: Every extra that installs a backend: the backends', then their variants' (uv's conflict set).
BACKEND_EXTRAS: tuple[str, ...] = BACKEND_NAMES + tuple(v.extra for s in SPECS for v in s.variants)
_SPECS_BY_NAME: dict[str, BackendSpec] = {spec.name: spec for spec in SPECS}


def _providers() -> tuple[Provider, ...]:
    """The modules' providers, a version-specific rule before the general one of the same
    distribution; then every spec's or variant's distribution that no rule names (a git build of
    DeepEP), whose layout alone tells the backend."""
    named = [p for s in SPECS for p in s.providers]
    order = list(dict.fromkeys(p.distribution for p in named))
    rules = sorted(named, key=lambda p: (order.index(p.distribution), p.major is None))
    dists = [d for s in SPECS for d in (s.distribution, *(v.distribution for v in s.variants))]
    generic = [Provider(d, None) for d in dict.fromkeys(dists) if d not in order]
    return (*rules, *generic)


#: Every distribution known to carry ``deep_ep``, including builds the lock does not use
#: (tokenspeed-deepep 2.x ships the v2 layout), in the order probes look for them.
PROVIDERS: tuple[Provider, ...] = _providers()


class UnknownBackendError(ValueError):
    """A backend name that is not in the registry; the message lists the valid ones."""


class RegistryError(RuntimeError):
    """pyproject.toml and this registry disagree (an extra or distribution was renamed)."""


# --- names ---------------------------------------------------------------------------------------


def spec(name: str) -> BackendSpec:
    """The spec of backend ``name`` (validated)."""
    return _SPECS_BY_NAME[validate_backend(name)]


def module_of(name: str, part: str) -> ModuleType:
    """A module a backend's package holds beside its SPEC (HybridEP's ``jit_cache``), found
    through the registry, so that code driving a ``deep_ep`` API names no backend itself."""
    return importlib.import_module(f"{__name__}.{validate_backend(name)}.{part}")


def valid_names_text() -> str:
    """The valid backend names as one line, for error messages and --help."""
    return ", ".join(BACKEND_NAMES)


def validate_backend(name: str) -> str:
    """Return ``name`` if it is a backend, else raise UnknownBackendError listing valid names."""
    if name in _SPECS_BY_NAME:
        return name
    raise UnknownBackendError(
        f"unknown EP backend {name!r}; valid backends: {valid_names_text()} "
        f"(or {ALL!r} where several are accepted)"
    )


def expand_backends(names: Iterable[str]) -> list[str]:
    """Validate ``names`` and expand ``all``; registry order, no repeats.

    Each item may hold several names joined by ``,`` (host mode's lists) or ``-`` (the image's
    EP values, which are stage names and cannot hold a comma).
    """
    wanted: set[str] = set()
    for item in names:
        for part in filter(None, (p.strip() for p in re.split(r"[,\s]+|-", item))):
            if part == ALL:
                wanted.update(BACKEND_NAMES)
            else:
                wanted.add(validate_backend(part))
    if not wanted:
        raise UnknownBackendError(f"no EP backend given; valid backends: {valid_names_text()}")
    return [name for name in BACKEND_NAMES if name in wanted]


def other_distributions(name: str) -> list[str]:
    """The distributions of every backend except ``name``, less its own (DeepEP v1 and HybridEP
    are both ``deep-ep`` from git: the layout tells them apart): none may share its venv, each
    backend's venv holding that backend alone."""
    own = normalize(spec(name).distribution)
    others = [s.distribution for s in SPECS if s.name != name]
    return list(dict.fromkeys(d for d in others if normalize(d) != own))


def modules() -> tuple[str, ...]:
    """The Python modules the backends ship (``deep_ep``, ``nccl.ep``), in registry order."""
    return tuple(dict.fromkeys(s.module for s in SPECS))


def conflict_sets() -> list[list[str]]:
    """The sets of extras uv must refuse together: the backends that ship one module (they
    overwrite each other's files: DeepEP v1, v2 and HybridEP all ship ``deep_ep``), and each
    variant with them. pyproject.toml's ``[tool.uv] conflicts`` opens with exactly these
    (tests/test_registry.py); a backend alone on its module conflicts with nothing."""
    sets: list[list[str]] = []
    for module in modules():
        names = [s.name for s in SPECS if s.module == module]
        if len(names) > 1:
            sets.append(names)
        sets += [[v.extra, *names] for s in SPECS if s.module == module for v in s.variants]
    return sets


def _module_of_distribution(distribution: str) -> str | None:
    """The module a known distribution installs (a spec's, a variant's or a provider's)."""
    norm = normalize(distribution)
    for s in SPECS:
        names = [s.distribution, *(v.distribution for v in s.variants)]
        names += [p.distribution for p in s.providers]
        if norm in {normalize(n) for n in names}:
            return s.module
    return None


def known_distributions(module: str | None = None) -> tuple[str, ...]:
    """Every distribution name known to install ``module`` (default: any backend's module),
    without repeats, in PROVIDERS order."""
    names = dict.fromkeys(p.distribution for p in PROVIDERS)
    return tuple(n for n in names if module is None or _module_of_distribution(n) == module)


def backend_of_distribution(distribution: str, version: str) -> str | None:
    """The backend a distribution stands for by name and version, or None if only the layout can
    tell (see PROVIDERS)."""
    norm = normalize(distribution)
    major = version.split(".", 1)[0]
    for provider in PROVIDERS:
        if normalize(provider.distribution) != norm:
            continue
        if provider.major is None or provider.major == major:
            return provider.backend
    return None


def layout_markers(module: str = MODULE) -> tuple[tuple[str, str], ...]:
    """(backend, marker inside the module's directory) of the backends shipping ``module``, in
    the order a detector must test them.

    A layout that also ships another backend's marker (the hybrid-ep branch keeps v1's
    ``buffer.py``) is tested before that backend; the rest newest first.
    """
    shipping = [s for s in SPECS if s.module == module]
    shadowing = [s for s in shipping if s.also_ships_markers_of]
    rest = [s for s in reversed(shipping) if not s.also_ships_markers_of]
    return tuple((s.name, s.layout_marker) for s in (*shadowing, *rest))


def layout_backend(package_dir: Path, module: str = MODULE) -> str | None:
    """The backend whose layout ``package_dir`` (an installed ``module`` directory) has, by its
    marker files; None if no backend's. DeepEP v1 and HybridEP are one distribution (``deep-ep``
    from git), so only the layout tells which commit a venv holds."""
    for backend, marker in layout_markers(module):
        if (package_dir / marker).is_file():
            return backend
    return None


def backend_facts(name: str, module_dir: Path) -> dict[str, object]:
    """What the backend's own ``facts_module`` reads of its installed native library, without
    importing the backend (check-env's report); {} for a backend without one."""
    part = spec(name).facts_module
    return dict(module_of(name, part).facts(module_dir)) if part else {}


def install_hint(name: str) -> str:
    """How a user gets backend ``name`` into the environment they run in."""
    return f'activate the {name} venv (eval "$(use-ep {name})") or uv sync --extra {name}'


# --- selections: EP and the active backend -------------------------------------------------------


#: Why the image takes one backend or all of them, for messages: a stage per subset would grow
#: as 2^n - 1 with the backends; host mode builds any subset.
IMAGE_EP_RULE = (
    "the image holds one backend (EP=<backend>) or every backend (EP=all); "
    "for another set, build EP=all (each extra backend adds only its own distribution) "
    "or use host mode, which builds any set"
)


def ep_value(backends: Iterable[str]) -> str:
    """The image's EP value (and stage suffix) for a selection: the backend's name, or ``all``;
    any other set is not an image (UnknownBackendError naming IMAGE_EP_RULE)."""
    selected = expand_backends(backends)
    if selected == list(BACKEND_NAMES):
        return ALL
    if len(selected) == 1:
        return selected[0]
    raise UnknownBackendError(f"{', '.join(selected)}: {IMAGE_EP_RULE}")


def image_ep_values() -> list[tuple[str, list[str]]]:
    """Every EP value the image accepts, with the backends each selects: each backend alone,
    then ``all``. Linear in the backends, as are the Dockerfile's stages."""
    return [*((name, [name]) for name in BACKEND_NAMES), (ALL, list(BACKEND_NAMES))]


def resolve_active(selected: Iterable[str], requested: str = "auto") -> str:
    """The backend to make active among ``selected``.

    ``auto``: DEFAULT_BACKEND if selected, else the first selected. Anything else must be one
    of the selected backends (UnknownBackendError names them otherwise).
    """
    chosen = expand_backends(selected)
    if requested in ("", "auto"):
        return DEFAULT_BACKEND if DEFAULT_BACKEND in chosen else chosen[0]
    validate_backend(requested)
    if requested not in chosen:
        raise UnknownBackendError(
            f"backend {requested!r} is not among the selected ones ({', '.join(chosen)}); "
            "pick one of them, or 'auto'"
        )
    return requested


# --- pins, read from pyproject.toml --------------------------------------------------------------


DEFAULT_PROJECT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Backend:
    """One EP backend as the build needs it: the spec plus what pyproject.toml pins.

    ``requirements`` and ``git`` come from pyproject.toml, so they always match the lock.
    """

    name: str
    extra: str
    distribution: str
    marker_file: str
    build_needs: tuple[str, ...]
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


def read_pyproject(project: Path = DEFAULT_PROJECT) -> dict:
    """Parse ``<project>/pyproject.toml``; the error names the flag that points elsewhere."""
    try:
        return read_toml(project / "pyproject.toml")
    except PinError as exc:
        raise RegistryError(str(exc)) from None


def _requirement_for(extra_reqs: list[str], distribution: str) -> str:
    """The requirement string in ``extra_reqs`` that names ``distribution``."""
    pattern = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
    for req in extra_reqs:
        match = pattern.match(req)
        if match and normalize(match.group(1)) == normalize(distribution):
            return req.strip()
    raise RegistryError(
        f"distribution {distribution!r} is not in the extra's requirements {extra_reqs}; "
        "update the backend's module in ep_image/backends/ to match pyproject.toml"
    )


def _backend(pyproject: dict, backend_spec: BackendSpec, variant: Variant | None = None) -> Backend:
    extra = variant.extra if variant else backend_spec.extra
    distribution = variant.distribution if variant else backend_spec.distribution
    extras = pyproject.get("project", {}).get("optional-dependencies", {})
    if extra not in extras:
        raise RegistryError(
            f"pyproject.toml has no extra {extra!r} under "
            f"[project.optional-dependencies]; the registry expects extras {valid_names_text()}"
        )
    reqs = [str(r) for r in extras[extra]]
    git, rev = git_source(pyproject, distribution, extra)
    return Backend(
        name=backend_spec.name,
        extra=extra,
        distribution=distribution,
        marker_file=backend_spec.marker_file,
        build_needs=variant.build_needs if variant else backend_spec.build_needs,
        requirements=tuple(reqs),
        requirement=_requirement_for(reqs, distribution),
        git=git,
        git_rev=rev,
    )


def load_registry(project: Path = DEFAULT_PROJECT) -> dict[str, Backend]:
    """Every backend, with its requirements and source read from pyproject.toml."""
    pyproject = read_pyproject(project)
    return {s.name: _backend(pyproject, s) for s in SPECS}


def get_backend(name: str, project: Path = DEFAULT_PROJECT, variant: str | None = None) -> Backend:
    """One backend by name (validated), read from ``project``'s pyproject.toml; ``variant``
    (an extra of its ``variants``) installs it from that source instead.

    Only this backend's extra must exist there, so a project that defines one backend (a test
    project, a fork) can build it.
    """
    backend_spec = spec(name)
    if variant is None or variant == backend_spec.extra:
        return _backend(read_pyproject(project), backend_spec)
    chosen = next((v for v in backend_spec.variants if v.extra == variant), None)
    if chosen is None:
        known = ", ".join(v.extra for v in backend_spec.variants) or "none"
        raise UnknownBackendError(f"{variant!r} is not a variant of {name} (its variants: {known})")
    return _backend(read_pyproject(project), backend_spec, chosen)


def workflow_matrix() -> dict[str, list[str]]:
    """What the CI workflows fan out over, so that no workflow lists a backend itself."""
    return {
        "backends": list(BACKEND_NAMES),
        "image_ep": [value for value, _ in image_ep_values()],
        "shares_gpu": [s.name for s in SPECS if s.shares_gpu],
    }
