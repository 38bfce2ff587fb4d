"""Create a venv with uv and sync extras of the committed uv.lock into it, never re-resolving.

Why: make_venv's backend venvs and build_te's throwaway build venv are made the same way.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from ep_image import SOURCE_ROOT
from ep_image.build_steps.uv_run import run


def create_venv(
    uv: str, venv: Path, python: str | None, project: Path, relocatable: bool = True
) -> None:
    """``uv venv`` run in ``project`` (its requires-python picks the interpreter).

    ``relocatable``: entry points find their interpreter relative to themselves and the activate
    scripts compute the venv's location, so a venv built under a temporary name can be renamed.
    """
    cmd = [uv, "venv", *(["--relocatable"] if relocatable else [])]
    if python:
        cmd += ["--python", python]
    run([*cmd, str(venv)], cwd=project)


def sync_environment(venv: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with uv syncing into ``venv``, and without
    ``UV_COMPILE_BYTECODE``: the build steps decide on bytecode themselves."""
    env = {**(os.environ if base is None else base), "UV_PROJECT_ENVIRONMENT": str(venv)}
    env.pop("UV_COMPILE_BYTECODE", None)
    return env


def sync_command(
    uv: str, project: Path, extras: list[str], skip: list[str], inexact: bool = False
) -> list[str]:
    """``uv sync --frozen`` of ``extras`` without the packages in ``skip``.

    The project is virtual (``[tool.uv] package = false``), so ``--no-install-project`` changes
    nothing today; it is there so that flipping that setting can never drop the repository itself
    into a venv. ``inexact``: keep what the venv holds beyond the lock (a skeleton's TE).
    """
    cmd = [uv, "sync", "--frozen", "--no-install-project", "--project", str(project)]
    for extra in extras:
        cmd += ["--extra", extra]
    if inexact:
        cmd.append("--inexact")
    for package in skip:
        cmd += ["--no-install-package", package]
    return cmd


def sync(
    uv: str,
    venv: Path,
    project: Path,
    extras: list[str],
    skip: list[str],
    env: Mapping[str, str] | None = None,
) -> None:
    """Sync ``extras`` of ``project``'s lock into ``venv`` (a BuildError if uv fails)."""
    cmd = sync_command(uv, project, extras, skip)
    run(cmd, env=dict(env) if env is not None else sync_environment(venv), cwd=project)


def install_package(uv: str, venv: Path) -> None:
    """This very ep_image (the one running, not ``--project``'s pins), editable and without
    dependencies: the venv's bin/ gets the probes (``check-ep``, ...) and its Python imports
    the same package as the build."""
    python = str(venv / "bin" / "python")
    run([uv, "pip", "install", "--python", python, "--no-deps", "--editable", str(SOURCE_ROOT)])
