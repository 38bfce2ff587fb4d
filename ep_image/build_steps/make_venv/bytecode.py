"""Bytecode for a backend venv that is identical across venvs, so dedup.py can share it.

Why: uv's own .pyc files embed the temporary build path and pin each source's mtime.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from ep_image.build_steps._venv.layout import site_packages


def wants_bytecode(flag: bool) -> bool:
    """--compile-bytecode, or uv's own switch UV_COMPILE_BYTECODE set in the environment."""
    value = os.environ.get("UV_COMPILE_BYTECODE", "").strip().lower()
    return flag or value not in ("", "0", "false", "no", "off")


def compile_bytecode(venv: Path, only: list[Path] | None = None) -> None:
    """Compile site-packages so that identical sources give identical .pyc files in every venv.

    uv's own compilation (UV_COMPILE_BYTECODE) writes timestamp-validated .pyc files that embed
    the absolute source path, here the temporary build path: they differ per venv, cannot be
    deduplicated, and pin each source's mtime (dedup.py then keeps those sources apart too).
    Instead: hash-checked .pyc files (valid whatever the mtime) with the path stored relative
    to site-packages (``-s``/``-p``); importlib rewrites ``co_filename`` to the real path when
    it loads a .pyc, so tracebacks still name the venv's files. ``-f``: a single timestamp .pyc
    left (e.g. ``_distutils_hack``'s, written when a ``.pth`` imports it at interpreter start)
    would make dedup.py link every ``.py`` only by mtime (measured: 1.05x instead of 1.02x for a
    second backend in the image). Files that do not compile
    (test data in some wheels) are skipped, as uv skips them. ``only``: just these sources
    (completing a skeleton: rewriting the skeleton's .pyc files would copy them into the layer).
    """
    sp = site_packages(venv)
    if only is not None and not only:
        return
    cmd = [
        str(venv / "bin" / "python"),
        "-m",
        "compileall",
        "-q",
        "-f",  # also the timestamp .pyc an interpreter start already wrote (a .pth's import)
        "-j",
        "0",
        "--invalidation-mode",
        "checked-hash",
        "-s",
        str(sp),
        "-p",
        "",
        *(["-i", "-"] if only is not None else [str(sp)]),
    ]
    print("+ " + " ".join(cmd) + (f" ({len(only)} new sources)" if only is not None else ""))
    sources = "".join(f"{path}\n" for path in only or [])
    proc = subprocess.run(cmd, input=sources, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        failed = sum(1 for line in proc.stdout.splitlines() if line.startswith("***"))
        print(f"make_venv: bytecode: {failed or 'some'} files did not compile (skipped)")


def python_sources(root: Path) -> dict[str, tuple[int, int, int]]:
    """relative path -> (inode, size, mtime_ns) of every ``.py`` file under ``root``."""
    state = {}
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            if name.endswith(".py"):
                st = os.lstat(os.path.join(dirpath, name))
                rel = os.path.relpath(os.path.join(dirpath, name), root)
                state[rel] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return state


def compile_new_sources(venv: Path, before: dict[str, tuple[int, int, int]]) -> None:
    """Compile only the sources that differ from ``before`` (``python_sources`` of the venv)."""
    new = [r for r, st in python_sources(venv).items() if before.get(r) != st]
    compile_bytecode(venv, [venv / r for r in sorted(new)])
