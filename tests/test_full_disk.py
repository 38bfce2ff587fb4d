"""A full disk: the build steps stop with a fix that names the full disk, not a permission.

Real file systems: a small tmpfs mounted here (root only), filled for real, under a tree_sync
target, a dedup ROOT and make_venv's prefix.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from _venv_helpers import make_uv_venv

from ep_image import backends


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs, unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small file system needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
        capture_output=True, text=True,
    )  # fmt: skip
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path, leave: int = 0) -> None:
    """Write until the disk is full, then free ``leave`` bytes."""
    with open(disk / "filler", "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * (64 << 10))
                fh.flush()
        except OSError:
            pass
    if leave:
        os.truncate(disk / "filler", max(0, (disk / "filler").stat().st_size - leave))


def module(name: str, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", f"ep_image.build_steps.{name}", *map(str, args)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip


def test_tree_sync_names_the_full_disk(small_disk: Path, tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    (source / "big.bin").write_bytes(os.urandom(8 << 20))
    proc = module("tree_sync", source, small_disk / "dst")
    assert proc.returncode == 1
    assert f"the disk holding {small_disk / 'dst'} is full" in proc.stderr, proc.stderr
    assert "writable by this user" not in proc.stderr


def test_dedup_read_only_names_the_full_disk(small_disk: Path) -> None:
    a = make_uv_venv(small_disk / "a")
    b = make_uv_venv(small_disk / "b")
    for root in (a, b):
        (root / "same.bin").write_bytes(b"x" * 4096)
    fill(small_disk)
    proc = module("dedup", "--read-only", a, b)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "is full" in proc.stderr and "run dedup as the owner" not in proc.stderr, proc.stderr


def test_make_venv_names_the_full_disk(small_disk: Path) -> None:
    proc = module(
        "make_venv", "--backend", backends.DEFAULT_BACKEND, "--prefix", small_disk / "venvs"
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "the disk filled up" in proc.stderr, proc.stderr[-2000:]
    assert "df -h" in proc.stderr
    assert sorted(p.name for p in (small_disk / "venvs").iterdir()) == [], "half-built venv left"
