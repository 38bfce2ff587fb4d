"""scripts/tree_sync.py: the target ends equal to the source, and only what differs is written.

The image's multi-backend assembly relies on both halves: equal (the assembled venv is the
backend stage's venv) and minimal (an untouched file keeps its inode, so it stays in the lower
layer instead of being copied into the new one).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import tree_sync
from _venv_helpers import tree_differences


def write(path: Path, text: str, mtime_ns: int | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if mtime_ns is not None:
        os.utime(path, ns=(mtime_ns, mtime_ns))
    return path


def test_target_ends_equal_and_only_differences_are_written(tmp_path: Path) -> None:
    src, dst, other = tmp_path / "src", tmp_path / "dst", tmp_path / "other"
    t0 = 1_700_000_000_000_000_000
    # Unchanged: same bytes and mtime (a file both got from one lower layer).
    write(src / "lib/same.py", "same\n", t0)
    write(dst / "lib/same.py", "same\n", t0)
    # Same bytes, other mtime (a tool rewrote it identically): kept as it is.
    write(src / "lib/rewritten.py", "identical\n", t0 + 5)
    write(dst / "lib/rewritten.py", "identical\n", t0)
    # Same size, other bytes and mtime: rewritten.
    write(src / "lib/changed.py", "new\n", t0 + 9)
    write(dst / "lib/changed.py", "old\n", t0)
    # Shared with another tree (a hardlinked skeleton): rewriting must not reach that tree.
    write(dst / "lib/shared.so", "skeleton's\n", t0)
    other.mkdir()
    os.link(dst / "lib/shared.so", other / "shared.so")
    write(src / "lib/shared.so", "backend's\n", t0 + 1)
    # New files and directories, a hardlinked pair, modes.
    write(src / "lib/deep_ep/__init__.py", "v2\n")
    os.link(src / "lib/deep_ep/__init__.py", src / "lib/deep_ep/alias.py")
    (src / "lib/deep_ep").chmod(0o750)
    write(src / "bin/tool", "#!/bin/sh\n").chmod(0o755)
    write(dst / "bin/tool", "#!/bin/sh\n").chmod(0o644)
    # Only in the target: removed (a file, a directory tree, the skeleton's record).
    write(dst / "ep-skeleton.json", "{}")
    write(dst / "lib/gone/deep/file.py", "x")
    # Symlinks: changed target, symlink replacing a file, a directory replacing a file.
    (src / "lib/link").symlink_to("same.py")
    (dst / "lib/link").symlink_to("changed.py")
    (src / "lib/was_file").symlink_to("same.py")
    write(dst / "lib/was_file", "file")
    write(src / "lib/now_dir/x.py", "x")
    write(dst / "lib/now_dir", "file")
    kept = {n: (dst / "lib" / n).stat().st_ino for n in ("same.py", "rewritten.py")}

    report = tree_sync.sync_tree(src, dst)

    assert tree_differences(dst, src) == []
    assert {n: (dst / "lib" / n).stat().st_ino for n in kept} == kept, "rewrote an equal file"
    assert (other / "shared.so").read_text() == "skeleton's\n", "a write reached the other tree"
    assert (dst / "lib/changed.py").stat().st_mtime_ns == t0 + 9, "written without its mtime"
    new = dst / "lib/deep_ep"
    assert (new / "__init__.py").stat().st_ino == (new / "alias.py").stat().st_ino
    assert sorted(report.removed) == ["ep-skeleton.json", "lib/gone"]
    assert report.files_written == 5  # changed, shared.so, __init__.py, now_dir/x.py, bin/tool
    assert report.links_made == 1 and report.symlinks_written == 2
    assert not list(dst.rglob("*.tree-sync-tmp"))
    # A second run finds nothing to do.
    again = tree_sync.sync_tree(src, dst)
    assert (again.files_written, again.links_made, again.removed) == (0, 0, [])


def test_missing_target_is_a_full_copy(tmp_path: Path) -> None:
    write(tmp_path / "src/a/b.txt", "b")
    (tmp_path / "src/a/c").symlink_to("b.txt")
    tree_sync.sync_tree(tmp_path / "src", tmp_path / "dst")
    assert tree_differences(tmp_path / "dst", tmp_path / "src") == []


def test_special_files_and_a_missing_source_are_refused(tmp_path: Path) -> None:
    with pytest.raises(tree_sync.SyncError, match="not a directory"):
        tree_sync.sync_tree(tmp_path / "absent", tmp_path / "dst")
    (tmp_path / "src").mkdir()
    os.mkfifo(tmp_path / "src" / "fifo")
    with pytest.raises(tree_sync.SyncError, match="not a file, directory or symlink"):
        tree_sync.sync_tree(tmp_path / "src", tmp_path / "dst")
