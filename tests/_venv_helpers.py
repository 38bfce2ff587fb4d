"""Helpers shared by the dedup / make_venv / use-ep tests: real uv venvs, real wheels.

Wheels are built here with the stdlib (zipfile) when a test needs a package whose content it
controls (two packages shipping the same path, a stand-in Transformer Engine wheel); everything
else is installed from PyPI by uv itself.
"""

from __future__ import annotations

import base64
import filecmp
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"  # the shell glue: use-ep, build_host.sh
#: copytree's ignore for a copy of the package
PYCACHE = shutil.ignore_patterns("__pycache__")


def uv(*args: str, env: dict[str, str] | None = None, check: bool = True, **kw):
    """Run uv; on failure the assertion shows its stderr."""
    proc = subprocess.run(
        ["uv", *args], env=env, capture_output=True, text=True, check=False, timeout=900, **kw
    )
    if check:
        assert proc.returncode == 0, f"uv {' '.join(args)}\n{proc.stdout}\n{proc.stderr}"
    return proc


def copy_env(**extra: str) -> dict[str, str]:
    """os.environ plus ``extra``; uv copies files (no links to its cache) unless told."""
    return {**os.environ, "UV_LINK_MODE": "copy", **extra}


def make_uv_venv(
    path: Path, *packages: str, seed: bool = False, python: str | None = None, **env: str
) -> Path:
    """``uv venv`` + ``uv pip install packages`` with UV_LINK_MODE=copy (separate copies)."""
    options = (["--seed"] if seed else []) + (["--python", python] if python else [])
    uv("venv", "-q", *options, str(path), env=copy_env(**env))
    if packages:
        install(path, *packages, **env)
    return path


def install(venv: Path, *args: str, **env: str) -> None:
    uv("pip", "install", "-q", "--python", str(venv / "bin" / "python"), *args, env=copy_env(**env))


def build_wheel(outdir: Path, name: str, version: str, files: dict[str, str | bytes]) -> Path:
    """A minimal, valid wheel holding ``files`` (path -> text or bytes), tagged py3-none-any."""
    dist = f"{name}-{version}.dist-info"
    content = dict(files)
    content[f"{dist}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    content[f"{dist}/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = []
    for path, text in content.items():
        data = text.encode() if isinstance(text, str) else text
        digest = hashlib.sha256(data).digest()
        b64 = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
        record.append(f"{path},sha256={b64},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    content[f"{dist}/RECORD"] = "\n".join(record) + "\n"
    outdir.mkdir(parents=True, exist_ok=True)
    wheel = outdir / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in content.items():
            zf.writestr(path, text)
    return wheel


def snapshot(root: Path) -> dict[str, tuple[str, int]]:
    """relative path -> (sha256, permission bits) of every regular file; symlinks by target."""
    result: dict[str, tuple[str, int]] = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = Path(dirpath, name)
            rel = str(path.relative_to(root))
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                result[rel] = ("symlink:" + os.readlink(path), 0)
            elif stat.S_ISREG(st.st_mode):
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
                result[rel] = (digest, stat.S_IMODE(st.st_mode))
    return result


def inodes(root: Path) -> dict[str, tuple[int, int]]:
    """relative path -> (st_dev, st_ino) of every regular file."""
    result = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = Path(dirpath, name)
            st = path.lstat()
            if stat.S_ISREG(st.st_mode):
                result[str(path.relative_to(root))] = (st.st_dev, st.st_ino)
    return result


def apparent_bytes(*roots: Path) -> int:
    """Sum of st_size of regular files, counting each inode once (what dedup reports)."""
    seen: dict[tuple[int, int], int] = {}
    for root in roots:
        for dirpath, _dirs, files in os.walk(root):
            for name in files:
                st = Path(dirpath, name).lstat()
                if stat.S_ISREG(st.st_mode):
                    seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def site_packages(venv: Path) -> Path:
    return next(venv.glob("lib/python3*/site-packages"))


def tree_differences(left: Path, right: Path) -> list[str]:
    """Paths whose type, mode, owner, bytes or link target differ (every file read in full)."""

    def entries(root: Path) -> dict[str, os.stat_result]:
        found = {}
        for dirpath, dirnames, filenames in os.walk(root):
            for name in [*dirnames, *filenames]:
                path = os.path.join(dirpath, name)
                found[os.path.relpath(path, root)] = os.lstat(path)
        return found

    a, b = entries(left), entries(right)
    differ = sorted(set(a) ^ set(b))
    for rel in sorted(set(a) & set(b)):
        x, y = a[rel], b[rel]
        if (x.st_mode, x.st_uid, x.st_gid) != (y.st_mode, y.st_uid, y.st_gid):
            differ.append(rel)
        elif stat.S_ISLNK(x.st_mode):
            if os.readlink(left / rel) != os.readlink(right / rel):
                differ.append(rel)
        elif stat.S_ISREG(x.st_mode) and (
            x.st_size != y.st_size or not filecmp.cmp(left / rel, right / rel, shallow=False)
        ):
            differ.append(rel)
    return differ


def run_dedup(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m ep_image.build_steps.dedup ARGS`` as a user runs it."""
    cmd = [sys.executable, "-m", "ep_image.build_steps.dedup", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def dedup_json(tmp: Path, *roots: Path, extra: tuple[str, ...] = ()) -> dict:
    """A dedup run that must pass; its ``--json`` report."""
    report = tmp / f"report-{time.monotonic_ns()}.json"
    proc = run_dedup(*extra, "--json", report, *roots)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(report.read_text())


def du_total(*roots: Path) -> int:
    """`du -sxcB1`'s total: disk bytes of every inode under ``roots``, each counted once."""
    out = subprocess.run(["du", "-sxcB1", *map(str, roots)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.splitlines()[-1].split()[0])
