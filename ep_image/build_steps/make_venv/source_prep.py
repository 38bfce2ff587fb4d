"""Ready the machine for a backend's source build before uv compiles it.

Why: a missing nvcc or header must be named before minutes of compile, and uv's cache rekeyed.
"""

from __future__ import annotations

from pathlib import Path

from ep_image import backends as ep_backends
from ep_image import source_build
from ep_image.build_steps._uv_run import BuildError


def prepare_source_build(
    uv: str,
    venv: Path,
    backend: ep_backends.Backend,
    project: Path,
    env: dict[str, str],
    exporting: bool = False,
) -> tuple[dict[str, str], dict[str, str | None]]:
    """Before a backend is compiled: what it will miss (with the fix), the NVML stub its
    multi-node build links, and uv's cache keyed on the build's environment inputs
    (ep_image/source_build.py). Returns the variables to add to the build's environment, and
    the build key (what a prebuilt wheel's record must match). ``exporting``: the wheel will be
    exported under this key, so a cached build made without one is compiled again."""
    variables = (
        source_build.declared_variables(ep_backends.read_pyproject(project), backend.distribution)
        if ep_backends.spec(backend.name).reads_build_variables
        else {}
    )
    needs_nvshmem = ep_backends.NVSHMEM in backend.build_needs
    problems = source_build.preflight(variables, env, nvshmem=needs_nvshmem)
    if problems:
        raise BuildError(f"{backend.name} cannot be built here:\n  - " + "\n  - ".join(problems))
    # Inside the temporary venv, which is renamed into place: removed after the build.
    links = source_build.driver_links(variables)
    extra = source_build.link_stubs(env, venv / source_build.SCRATCH, links)
    if source_build.multinode_doca(variables):  # setup.py runs NCCL's `make -j` unbounded
        extra.update(source_build.bounded_make(env, venv / source_build.SCRATCH))
    key = source_build.build_key({**env, **extra}, variables)
    try:
        state = source_build.refresh_cache(
            uv, backend.distribution, key, env, backend.extra, drop_unkeyed=exporting
        )
    except source_build.CacheError as exc:
        raise BuildError(f"{backend.name}: {exc}") from None
    print(
        f"make_venv: {backend.name}: build key {source_build.key_digest(key)[:12]} ({state}"
        + ("; its cached builds dropped" if state == "changed" or exporting else "")
        + f"){', driver stubs on LIBRARY_PATH' if 'LIBRARY_PATH' in extra else ''}"
        + f"{', make -j bounded to ' + extra['EP_MAKE_JOBS'] if 'EP_MAKE_JOBS' in extra else ''}",
        flush=True,
    )
    return extra, key
