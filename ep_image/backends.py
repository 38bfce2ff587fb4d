"""The expert-parallel (EP) backend registry: the one place where a backend is defined.

Why this module exists: DeepEP v1, DeepEP v2 and HybridEP all ship the Python module
``deep_ep``, so a venv holds exactly one of them, chosen through a uv extra of the same name.
The build scripts, the probes, the Dockerfile's stages and the CI workflows must agree on those
names, on how to recognise each backend once installed, on the default, and on what a backend
needs to build. All of that is here; everything else imports it (``scripts/``, ``probes/``) or
is checked against it by a test (the Dockerfile's generated stages, ``docker/select-ep``'s
input, the workflow matrix).

What is *not* here: versions and git commits. Those are pins, and pins live in
``pyproject.toml`` and ``uv.lock`` only; ``load_registry`` reads them from there and fails
loudly when an extra or distribution named here is missing.

Adding a backend: add a ``BackendSpec`` to ``SPECS`` and its extra to pyproject.toml, run
``python -m ep_image.dockerfile --write``, add it to the workflows' ``ep`` lists; the tests
name whatever still disagrees.

Run it to see the registry: ``python -m ep_image.backends [--json | --names | --image-ep]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from ep_image.project import PinError, git_source, normalize, read_toml

#: The Python module every backend ships (why they conflict).
MODULE = "deep_ep"

#: Selects every backend where a caller accepts several (host mode, the image's EP).
ALL = "all"

#: What ``build_needs`` may hold. NVSHMEM: the source build links NVSHMEM from NVSHMEM_DIR;
#: ep_image/build/make_venv.py points that at the venv's own nvidia-nvshmem (ep_image/nvshmem.py).
NVSHMEM = "nvshmem"
#: NCCL: the source build links ``-l:libnccl.so.2`` without a ``-L`` for it (DeepEP v2's
#: setup.py at af9a0403); make_venv puts the venv's own nvidia-nccl on that build's LIBRARY_PATH.
NCCL = "nccl"


@dataclass(frozen=True)
class Variant:
    """Another uv extra that installs the same backend from another source.

    Same module layout, same probes, same venv name (``<prefix>/<backend>``); only where the
    distribution comes from differs (``make_venv.py --variant EXTRA``).
    """

    extra: str
    distribution: str
    summary: str
    #: Build-time needs of this source (see NVSHMEM, NCCL), in place of the backend's.
    build_needs: tuple[str, ...] = ()


@dataclass(frozen=True)
class BackendSpec:
    """What identifies a backend; no pins (those are read from pyproject.toml)."""

    #: Backend name, also the uv extra and the image's stage suffix (no "-": it joins names).
    name: str
    #: For people: what it is and its main buffer class.
    title: str
    #: The distribution that installs this backend's ``deep_ep`` in the lock.
    distribution: str
    #: A path inside ``deep_ep/`` that only this backend's layout ships.
    layout_marker: str
    #: Backends whose marker this layout ships as well (so this marker is tested first).
    also_ships_markers_of: tuple[str, ...] = ()
    #: Compiled during the build (its image stage then takes the arch list and job count).
    builds_from_source: bool = False
    #: Build-time needs the build scripts act on (see NVSHMEM).
    build_needs: tuple[str, ...] = ()
    #: What building it needs from the machine, for error messages and docs.
    build_hint: str = "prebuilt wheel from PyPI: nothing to compile"
    #: Its compiled extension links NVSHMEM when built with it (internode and low-latency
    #: kernels); a build without NVSHMEM silently loses them, so the probes report which it is.
    links_nvshmem: bool = False
    #: How the probes judge its internode support from the build: "nvshmem" (the extension
    #: links libnvshmem_host), "rdma" (links libibverbs/libmlx5 or NIXL: a multinode build),
    #: "nccl_gin" (NCCL >= 2.30 with GPU-initiated networking).
    internode_check: str = ""
    #: Needs NCCL GIN, hence an RDMA NIC, even on one node.
    needs_nccl_gin: bool = False
    #: Its own test in its repository, under tests/ at the commit its layout follows (the
    #: upstream-test oracle, upstream_test.py), and whether several ranks may share a GPU
    #: there (False: it builds NCCL communicators, which refuse that).
    upstream_test: str = ""
    shares_gpu: bool = True
    #: pyproject.toml's [tool.uv.extra-build-variables] of its distribution are its switches
    #: (HybridEP's multi-node build); a variant sharing the distribution ignores them.
    reads_build_variables: bool = False
    #: Other extras that install this backend from another source.
    variants: tuple[Variant, ...] = ()

    @property
    def extra(self) -> str:
        return self.name

    @property
    def marker_file(self) -> str:
        """The layout marker relative to site-packages."""
        return f"{MODULE}/{self.layout_marker}"


#: The backends, in the order scripts build and list them.
SPECS: tuple[BackendSpec, ...] = (
    BackendSpec(
        name="deepep_v1",
        title="DeepEP v1 (deep_ep.Buffer)",
        distribution="deep-ep",
        layout_marker="buffer.py",
        builds_from_source=True,
        build_needs=(NVSHMEM,),
        links_nvshmem=True,
        internode_check="nvshmem",
        upstream_test="test_intranode.py",
        build_hint=(
            "compiled from its pinned git commit against the venv's torch and NVSHMEM: needs git "
            "access to the commit (GitHub, or a mirror through url.<mirror>.insteadOf), a CUDA "
            "toolkit with nvcc, and libcuda.so to link (the driver's, or the toolkit's stub)"
        ),
    ),
    BackendSpec(
        name="deepep_v2",
        title="DeepEP v2 (deep_ep.ElasticBuffer; JIT: needs a CUDA home with nvcc at run time)",
        distribution="sgl-deep-ep",
        layout_marker="buffers/elastic.py",
        internode_check="nccl_gin",
        needs_nccl_gin=True,
        upstream_test="elastic/test_ep.py",
        shares_gpu=False,
        variants=(
            Variant(
                extra="deepep_v2_pinned",
                distribution="deep-ep",
                summary=(
                    "upstream DeepEP at the seed's pinned commit, built from source (nvcc, "
                    "NCCL >= 2.30 from the lock) instead of SGLang's wheel"
                ),
                build_needs=(NCCL,),
            ),
        ),
    ),
    BackendSpec(
        name="hybridep",
        title="HybridEP (deep_ep.HybridEPBuffer, NVIDIA's hybrid-ep branch of DeepEP)",
        distribution="deep-ep",
        layout_marker="hybrid_ep_buffer.py",
        also_ships_markers_of=("deepep_v1",),
        builds_from_source=True,
        build_needs=(NVSHMEM,),
        links_nvshmem=True,
        internode_check="rdma",
        upstream_test="test_hybrid_ep.py",
        reads_build_variables=True,
        build_hint=(
            "compiled from its pinned git commit, multi-node (HYBRID_EP_MULTINODE=1): needs git "
            "access to the commit and its NVIDIA/nccl submodule (GitHub, or a mirror through "
            "url.<mirror>.insteadOf), a CUDA toolkit with nvcc and the libcuda and NVML stubs, "
            "and rdma-core's headers (libibverbs-dev)"
        ),
    ),
)

#: The backend an image or host prefix makes active when nothing else is asked for, and the
#: image's default EP. The `moe` extra of pyproject.toml holds the same one (a test checks).
DEFAULT_BACKEND = "deepep_v2"

BACKEND_NAMES: tuple[str, ...] = tuple(spec.name for spec in SPECS)
#: Every extra that installs a backend: the backends', then their variants' (uv's conflict set).
BACKEND_EXTRAS: tuple[str, ...] = BACKEND_NAMES + tuple(v.extra for s in SPECS for v in s.variants)
_SPECS_BY_NAME: dict[str, BackendSpec] = {spec.name: spec for spec in SPECS}


@dataclass(frozen=True)
class Provider:
    """A distribution known to install ``deep_ep`` and the backend its name stands for.

    ``backend`` None: the name alone does not tell (a git build of DeepEP); the file layout
    decides. ``major``: the rule applies only to versions with this major number.
    """

    distribution: str
    backend: str | None
    major: str | None = None


#: Every distribution known to carry ``deep_ep``, including builds the lock does not use
#: (tokenspeed-deepep 2.x ships the v2 layout), in the order probes look for them.
PROVIDERS: tuple[Provider, ...] = (
    Provider("sgl-deep-ep", "deepep_v2"),
    Provider("tokenspeed-deepep", "deepep_v1", major="1"),
    Provider("tokenspeed-deepep", "deepep_v2"),
    Provider("deep-ep", None),
)


class UnknownBackendError(ValueError):
    """A backend name that is not in the registry; the message lists the valid ones."""


class RegistryError(RuntimeError):
    """pyproject.toml and this registry disagree (an extra or distribution was renamed)."""


# --- names ---------------------------------------------------------------------------------------


def spec(name: str) -> BackendSpec:
    """The spec of backend ``name`` (validated)."""
    return _SPECS_BY_NAME[validate_backend(name)]


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
    are both ``deep-ep`` from git: the layout tells them apart): none may share its venv."""
    own = normalize(spec(name).distribution)
    others = [s.distribution for s in SPECS if s.name != name]
    return list(dict.fromkeys(d for d in others if normalize(d) != own))


def known_distributions() -> tuple[str, ...]:
    """Every distribution name known to install ``deep_ep``, without repeats, in PROVIDERS order."""
    return tuple(dict.fromkeys(p.distribution for p in PROVIDERS))


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


def layout_markers() -> tuple[tuple[str, str], ...]:
    """(backend, marker inside ``deep_ep/``) in the order a detector must test them.

    A layout that also ships another backend's marker (the hybrid-ep branch keeps v1's
    ``buffer.py``) is tested before that backend; the rest newest first.
    """
    shadowing = [s for s in SPECS if s.also_ships_markers_of]
    rest = [s for s in reversed(SPECS) if not s.also_ships_markers_of]
    return tuple((s.name, s.layout_marker) for s in (*shadowing, *rest))


def layout_backend(package_dir: Path) -> str | None:
    """The backend whose layout ``package_dir`` (an installed ``deep_ep`` directory) has, by its
    marker files; None if no backend's. DeepEP v1 and HybridEP are one distribution (``deep-ep``
    from git), so only the layout tells which commit a venv holds."""
    for backend, marker in layout_markers():
        if (package_dir / marker).is_file():
            return backend
    return None


def install_hint(name: str) -> str:
    """How a user gets backend ``name`` into the environment they run in."""
    return f'activate the {name} venv (eval "$(use-ep {name})") or uv sync --extra {name}'


# --- selections: EP and the active backend -------------------------------------------------------


def ep_value(backends: Iterable[str]) -> str:
    """The image's EP value (and stage suffix) for a selection: ``all``, or names joined by ``-``
    in registry order."""
    selected = expand_backends(backends)
    return ALL if selected == list(BACKEND_NAMES) else "-".join(selected)


def image_ep_values() -> list[tuple[str, list[str]]]:
    """Every EP value the image accepts, with the backends each selects: each backend alone,
    each larger subset joined by ``-`` in registry order, and ``all`` for every backend."""
    values = []
    for size in range(1, len(BACKEND_NAMES) + 1):
        for combo in itertools.combinations(BACKEND_NAMES, size):
            values.append((ep_value(combo), list(combo)))
    return values


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


DEFAULT_PROJECT = Path(__file__).resolve().parent.parent


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
        "update SPECS in ep_image/backends.py to match pyproject.toml"
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


# --- CLI -----------------------------------------------------------------------------------------


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="ep_backends",
        description=(
            "Print the EP backend registry (ep_image/backends.py): each backend's uv extra, the "
            "distribution that ships its `deep_ep` module, the marker file that identifies its "
            "layout, what its build needs, and its requirement and source as pyproject.toml "
            "pins them."
        ),
        epilog=f"Backends: {valid_names_text()}; default: {DEFAULT_BACKEND}.",
    )
    parser.add_argument(
        "--project",
        type=Path,
        default=DEFAULT_PROJECT,
        help="directory holding pyproject.toml (default: this repository)",
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--json", action="store_true", help="print the registry as JSON")
    group.add_argument(
        "--names", action="store_true", help="print only the backend names, one a line"
    )
    group.add_argument(
        "--image-ep",
        action="store_true",
        help="print every EP value the image accepts and the backends it selects",
    )
    group.add_argument("--default", action="store_true", help="print the default backend")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.names:
        print("\n".join(BACKEND_NAMES))
        return 0
    if args.default:
        print(DEFAULT_BACKEND)
        return 0
    if args.image_ep:
        for value, backends in image_ep_values():
            print(f"{value}\t{' '.join(backends)}")
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
        default = " (default)" if backend.name == DEFAULT_BACKEND else ""
        print(
            f"{backend.name:10} extra={backend.extra} dist={backend.distribution} "
            f"req={backend.requirement!r} source={backend.source_label} "
            f"marker={backend.marker_file}{default}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
