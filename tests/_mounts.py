"""Real mounts for the tests: bind mounts and overlays, always taken down again.

Why: the same tree reached by two paths (a bind mount) and a container layer (overlayfs) are
where path strings and `du` lie; only real mounts show what the tools do there. Mounting needs
root; ``why_not()`` says why a test must skip. Each mount is unmounted when its ``with`` ends,
whatever happened inside, so no test leaves one behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path


def why_not(kind: str = "bind") -> str | None:
    """Why this machine cannot make a ``kind`` mount for a test (None: it can)."""
    if os.geteuid() != 0:
        return f"a {kind} mount needs root"
    if shutil.which("mount") is None or shutil.which("umount") is None:
        return "needs mount and umount (util-linux)"
    if kind == "overlay":
        try:
            filesystems = Path("/proc/filesystems").read_text()
        except OSError:
            return "cannot read /proc/filesystems"
        if "overlay" not in filesystems.split():
            probe = subprocess.run(["modprobe", "overlay"], capture_output=True, check=False)
            if probe.returncode != 0:
                return "this kernel has no overlayfs"
    return None


def _umount(target: Path) -> None:
    done = subprocess.run(["umount", str(target)], capture_output=True, text=True, check=False)
    if done.returncode != 0:  # busy: detach it now, the kernel frees it when unused
        subprocess.run(["umount", "-l", str(target)], check=True, capture_output=True)


@contextlib.contextmanager
def bind(source: Path, target: Path) -> Iterator[Path]:
    """``mount --bind source target`` for the ``with`` block (``target`` is made if missing)."""
    target.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "--bind", str(source), str(target)], check=True, capture_output=True)
    try:
        yield target
    finally:
        _umount(target)


@contextlib.contextmanager
def overlay(base: Path, lower: Path) -> Iterator[tuple[Path, Path]]:
    """An overlay of ``lower`` with a fresh upper layer under ``base``: (merged, upper)."""
    upper, work, merged = base / "upper", base / "work", base / "merged"
    for directory in (upper, work, merged):
        directory.mkdir(parents=True)
    options = f"lowerdir={lower},upperdir={upper},workdir={work}"
    subprocess.run(
        ["mount", "-t", "overlay", "overlay", "-o", options, str(merged)],
        check=True,
        capture_output=True,
    )
    try:
        yield merged, upper
    finally:
        _umount(merged)
