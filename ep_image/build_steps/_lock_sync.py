"""Create a venv with uv and sync extras of the committed uv.lock into it, never re-resolving.

Why: make_venv's backend venvs and build_te's throwaway build venv are made the same way.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from pathlib import Path

from ep_image import SOURCE_ROOT
from ep_image.build_steps._uv.run import BuildError, run


def check_lock(uv: str, project: Path) -> None:
    """BuildError unless uv.lock is the lock of pyproject.toml as it stands (``uv lock --check``,
    which needs no network when they agree). Why: ``uv sync --frozen`` installs the lock as it
    is, so a pyproject.toml changed without ``uv lock`` would build the stale lock and record
    the new pyproject's hash."""
    proc = subprocess.run(
        [uv, "lock", "--check", "--project", str(project)],
        capture_output=True, text=True, cwd=project, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        said = "\n".join(line for line in proc.stderr.splitlines() if line.strip())[-600:]
        raise BuildError(
            f"{project / 'uv.lock'} is not the lock of {project / 'pyproject.toml'} as it "
            f"stands (changed without `uv lock`, or uv could not check it here); uv said:\n"
            f"{said}\nNothing was built. Fix: run `uv lock` in {project} and keep both files "
            "together"
        )


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
