"""Ready the machine for a backend's source build before uv compiles it.

Why: a missing nvcc or header must be named before minutes of compile, and uv's cache rekeyed.
"""

from __future__ import annotations

from pathlib import Path

from ep_image import backends as ep_backends
from ep_image.build_steps._source_builds import toolchain, uv_cache
from ep_image.build_steps._uv.run import BuildError


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
    (_source_builds/: toolchain.py, uv_cache.py). Returns the variables to add to the build's
    environment, and the build key (what a prebuilt wheel's record must match).
    ``exporting``: the wheel will be exported under this key, so a cached build made without
    one is compiled again."""
    variables = (
        toolchain.declared_variables(ep_backends.read_pyproject(project), backend.distribution)
        if ep_backends.spec(backend.name).reads_build_variables
        else {}
    )
    needs_nvshmem = ep_backends.NVSHMEM in backend.build_needs
    problems = toolchain.preflight(variables, env, nvshmem=needs_nvshmem)
    if problems:
        raise BuildError(f"{backend.name} cannot be built here:\n  - " + "\n  - ".join(problems))
    # Inside the temporary venv, which is renamed into place: removed after the build.
    links = toolchain.driver_links(variables)
    extra = toolchain.link_stubs(env, venv / toolchain.SCRATCH, links)
    if toolchain.multinode_doca(variables):  # setup.py runs NCCL's `make -j` unbounded
        extra.update(toolchain.bounded_make(env, venv / toolchain.SCRATCH))
    key = uv_cache.build_key({**env, **extra}, variables)
    try:
        state = uv_cache.refresh_cache(
            uv, backend.distribution, key, env, backend.extra, drop_unkeyed=exporting
        )
    except uv_cache.CacheError as exc:
        raise BuildError(f"{backend.name}: {exc}") from None
    print(
        f"make_venv: {backend.name}: build key {uv_cache.key_digest(key)[:12]} ({state}"
        + ("; its cached builds dropped" if state == "changed" or exporting else "")
        + f"){', driver stubs on LIBRARY_PATH' if 'LIBRARY_PATH' in extra else ''}"
        + f"{', make -j bounded to ' + extra['EP_MAKE_JOBS'] if 'EP_MAKE_JOBS' in extra else ''}",
        flush=True,
    )
    return extra, key
