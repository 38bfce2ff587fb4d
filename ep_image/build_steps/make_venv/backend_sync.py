"""Sync one backend's extra of the lock into its venv, a git source built on its NVSHMEM/NCCL.

Why: host mode and the image's ep stages must build each backend identically (one code path).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ep_image import backends as ep_backends
from ep_image.build_steps import _lock_sync
from ep_image.build_steps._source_builds import nvshmem, prebuilt, toolchain
from ep_image.build_steps._te_wheels import TE_DISTRIBUTION, TE_EXTRA
from ep_image.build_steps._uv.run import BuildError, run, sync_failure
from ep_image.build_steps._venv.layout import site_packages
from ep_image.build_steps.make_venv import backend_wheels
from ep_image.build_steps.make_venv.source_prep import prepare_source_build


@dataclass(frozen=True)
class Wheels:
    """Prebuilt wheels of source-built backends: a directory to take a matching one from, and
    one to export a freshly compiled one to (either may be None)."""

    take_from: Path | None = None
    export_to: Path | None = None


def sync_backend(
    uv: str,
    venv: Path,
    backend: ep_backends.Backend,
    project: Path,
    skip: list[str],
    te: bool,
    inexact: bool = False,
    wheels: Wheels | None = None,
) -> dict[str, object] | None:
    """Sync the backend's extra into ``venv``; returns the build set-up record, if it needed one.

    ``te``: also the ``te`` extra (TE's runtime dependencies and the cuDNN it was built against
    come from the lock, only TE itself from the prebuilt wheel, so TE is never synced).
    ``inexact``: completing a skeleton, which already holds TE (installed apart from the lock).
    A backend whose build needs the venv's NVSHMEM or NCCL is synced in two steps: all but its
    distribution, then the distribution built against the venv's libraries (NVSHMEM:
    ep_image/build_steps/_source_builds/nvshmem.py with a ``$ORIGIN`` runpath, checked
    afterwards; NCCL: on the build's LIBRARY_PATH). ``wheels``: where to take a prebuilt wheel
    of that distribution from, when its record matches this build, and where to export the one
    compiled here (ep_image/build_steps/make_venv/backend_wheels.py).
    """
    env = _lock_sync.sync_environment(venv)
    extras = [backend.extra, *([TE_EXTRA] if te else [])]
    cmd = _lock_sync.sync_command(uv, project, extras, [TE_DISTRIBUTION, *skip], inexact)
    skipped = any(
        ep_backends.normalize(p) == ep_backends.normalize(backend.distribution) for p in skip
    )
    # A git source is compiled here: NVSHMEM set-up and checks where the registry says so (a
    # prebuilt wheel, in a fork or a test project, brings its own runpath; the ABI check binds it).
    compiled = bool(backend.git) and not skipped
    builds_nvshmem = ep_backends.NVSHMEM in backend.build_needs and compiled
    links_nccl = ep_backends.NCCL in backend.build_needs and compiled
    wheels = wheels or Wheels()
    choice, wanted = prebuilt.Choice(None, None, ()), {}
    if compiled:
        exporting = wheels.export_to is not None
        extra, key = prepare_source_build(uv, venv, backend, project, env, exporting)
        env.update(extra)
        wanted = backend_wheels.expected(backend, project, key)
        choice = backend_wheels.choose(wheels.take_from, backend, wanted)
        if wheels.take_from is not None:
            print(choice.say("make_venv", backend.name, wheels.take_from), flush=True)
    try:
        if choice.wheel is not None:
            run([*cmd, "--no-install-package", backend.distribution], env=env, cwd=project)
            backend_wheels.install(uv, venv, choice.wheel)
            taken: dict[str, object] = {"prebuilt": {**(choice.record or {})}}
            if builds_nvshmem:
                taken["extension"] = nvshmem.check_extension(venv)
            return taken
        if not (builds_nvshmem or links_nccl):
            run(cmd, env=env, cwd=project)
            built: dict[str, object] | None = None
        else:
            built = _build_on_venv_libraries(uv, venv, backend, project, cmd, env, builds_nvshmem)
        if compiled and wheels.export_to is not None:
            backend_wheels.export(uv, env, venv, backend, wanted, wheels.export_to)
        return built
    except (nvshmem.NvshmemError, toolchain.LinkError) as exc:
        raise BuildError(f"{backend.name}: {exc}") from None
    except BuildError as exc:
        raise sync_failure(backend, str(exc)) from None


def _build_on_venv_libraries(
    uv: str,
    venv: Path,
    backend: ep_backends.Backend,
    project: Path,
    cmd: list[str],
    env: dict[str, str],
    builds_nvshmem: bool,
) -> dict[str, object]:
    """All but the distribution, then the distribution built against the venv's NVSHMEM
    (checked afterwards) or NCCL; the set-up used, for the venv's record."""
    run([*cmd, "--no-install-package", backend.distribution], env=env, cwd=project)
    build_env = nvshmem.build_environment(venv, env) if builds_nvshmem else {}
    if ep_backends.NCCL in backend.build_needs:
        build_env.update(toolchain.nccl_link(site_packages(venv), {**env, **build_env}))
    print(f"make_venv: {backend.name}: building against {build_env}", flush=True)
    run(cmd, env={**env, **build_env}, cwd=project)
    if not builds_nvshmem:
        return build_env
    try:
        checked = nvshmem.check_extension(venv)
    except nvshmem.NvshmemError as exc:
        # A wheel from uv's cache built without this set-up: rebuild it once, here.
        print(f"make_venv: {exc}\nmake_venv: rebuilding {backend.distribution}", flush=True)
        refresh = ["--refresh-package", backend.distribution]
        refresh += ["--reinstall-package", backend.distribution]
        run([*cmd, *refresh], env={**env, **build_env}, cwd=project)
        checked = nvshmem.check_extension(venv)
    return {**build_env, "extension": checked}
