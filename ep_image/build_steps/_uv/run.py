"""Run uv for the build steps and turn its failures into one error that names the fix.

Why: make_venv and build_te stream long uv runs and must classify what went wrong afterwards.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ep_image.build_steps._uv import pinned

if TYPE_CHECKING:
    from ep_image.backends import Backend

_GIT_FAILURE_SIGNS = ("git operation failed", "failed to clone", "failed to fetch commit")
_DISK_FULL_SIGNS = ("no space left on device", "os error 28", "disk quota exceeded")


class BuildError(RuntimeError):
    """The venv could not be built; the message says why and what fixes it."""


def uv_executable() -> str:
    """Path of uv, or a BuildError naming the pinned version and how to install it."""
    try:
        return pinned.find_uv()
    except pinned.ToolError as exc:
        raise BuildError(str(exc)) from None


def run(cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    """Run ``cmd``, streaming its output (long builds stay visible), and return its stderr.

    On failure raises BuildError carrying that stderr, for callers to classify.
    """
    print("+ " + " ".join(cmd), flush=True)
    try:
        started = subprocess.Popen(cmd, env=env, cwd=cwd, stderr=subprocess.PIPE, text=True)
    except OSError as exc:  # no such program, or no such directory to run it in
        raise BuildError(f"cannot run {cmd[0]} in {cwd or Path.cwd()}: {exc}") from None
    with started as proc:
        assert proc.stderr is not None
        lines = []
        try:
            for line in proc.stderr:
                sys.stderr.write(line)
                lines.append(line)
        except BaseException:  # interrupted or terminated: uv must not go on writing the venv
            stop(proc)
            raise
    sys.stderr.flush()
    stderr = "".join(lines)
    if proc.returncode != 0:
        raise BuildError(stderr or f"{cmd[0]} exited with {proc.returncode}")
    return stderr


def stop(proc: subprocess.Popen[str], grace: float = 10.0) -> None:
    """End a child that is still running: SIGTERM, then SIGKILL after ``grace`` seconds."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def tail(text: str, count: int = 6) -> str:
    """The last ``count`` non-blank lines of a tool's output (the rest is printed above)."""
    return "\n".join([line for line in text.splitlines() if line.strip()][-count:])


def looks_like_git_failure(uv_error: str) -> bool:
    """Whether uv's error is a git source that could not be cloned or fetched."""
    lowered = uv_error.lower()
    return any(sign in lowered for sign in _GIT_FAILURE_SIGNS)


def git_fix_message(backend: Backend, uv_error: str) -> str:
    """The error for a git source that could not be cloned, naming both fixes: network to
    GitHub, or a mirror through git's ``url.<mirror>.insteadOf`` (in an image build: the
    ``gitconfig`` build secret)."""
    return (
        f"{backend.name}: uv could not clone the git source of {backend.distribution} "
        f"({backend.source_label}), pinned in pyproject.toml [tool.uv.sources]. "
        "The fetch failed (no route to GitHub, or a git mirror that lacks the commit). "
        "Fix: give the build network access to github.com, "
        "or point git at a mirror that holds that commit (and its submodules), e.g. "
        f"`git config --global url.<mirror-url>.insteadOf {backend.git}` "
        "(in an image build: pass that git config as the build secret `gitconfig`, "
        "docs/image.md). "
        f"uv's error (in full above) ends:\n{tail(uv_error)}"
    )


def disk_full(uv_error: str) -> bool:
    """Whether uv (or a build it ran) stopped on a full disk."""
    lowered = uv_error.lower()
    return any(sign in lowered for sign in _DISK_FULL_SIGNS)


def sync_failure(backend: Backend, uv_error: str) -> BuildError:
    """What a failed ``uv sync`` of ``backend`` means: a full disk, a git clone that failed, or
    else uv's own error, ended by its last lines."""
    if disk_full(uv_error):
        return BuildError(
            f"{backend.name}: the disk filled up during uv sync. Fix: free space where the venvs "
            "go and where uv keeps its cache (df -h <prefix> $(uv cache dir)), then run again. "
            f"uv's error ends:\n{tail(uv_error)}"
        )
    if backend.git and looks_like_git_failure(uv_error):
        return BuildError(git_fix_message(backend, uv_error))
    return BuildError(f"{backend.name}: uv sync failed (output above); it ends:\n{tail(uv_error)}")
