"""tree_sync.py: the target ends equal to the source, and only what differs is written.

The image's multi-backend assembly relies on both halves: equal (the assembled venv is the
backend stage's venv) and minimal (an untouched file keeps its inode, so it stays in the lower
layer instead of being copied into the new one).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import _mounts as mounts
import pytest
from _venv_helpers import PYCACHE, ROOT, tree_differences

from ep_image.build_steps import tree_sync

NOBODY = 65534


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
    assert not list(dst.rglob(".tree-sync-*")), "a temporary file was left"
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


def _run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ep_image.build_steps.tree_sync", *map(str, args)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("source", "target", "said"),
    [
        ("big/s", "big", "is inside TARGET"),  # before: emptied big/, its source included
        (
            "big",
            "big/s/deeper",
            "is inside SOURCE",
        ),  # before: copied into itself until ENAMETOOLONG
        ("big", "big", "the same directory"),
        ("big/s", "alias", "is inside TARGET"),  # the same through a symbolic link
    ],
)
def test_nested_trees_are_refused_before_anything_is_written(
    tmp_path: Path, source: str, target: str, said: str
) -> None:
    write(tmp_path / "big/s/keep.py", "keep\n")
    write(tmp_path / "big/other.py", "other\n")
    (tmp_path / "alias").symlink_to(tmp_path / "big")
    before = _state(tmp_path / "big")
    proc = _run(tmp_path / source, tmp_path / target)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert said in proc.stderr and "nothing was written" in proc.stderr
    assert "fix:" in proc.stderr
    assert _state(tmp_path / "big") == before


def _state(root: Path) -> dict[str, tuple[int, int, int, bytes | str]]:
    """Every entry of ``root``: inode, mode, mtime and content (a symlink's target)."""
    found: dict[str, tuple[int, int, int, bytes | str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                content: bytes | str = Path(path).read_bytes()
            elif stat.S_ISLNK(st.st_mode):
                content = os.readlink(path)
            else:
                content = ""
            found[os.path.relpath(path, root)] = (st.st_ino, st.st_mode, st.st_mtime_ns, content)
    return found


def _old_and_new(src: Path, dst: Path) -> None:
    """A target holding last build's venv, a source that changed it: entries before the bad one
    in the walk's order (the top level) would be written first."""
    write(dst / "a_changed.py", "old\n")
    write(src / "a_changed.py", "new and longer\n")
    write(dst / "b_removed.py", "only in the target\n")
    write(src / "c_new.py", "new\n")
    write(dst / "lib/kept.py", "kept\n", 1_700_000_000_000_000_000)
    write(src / "lib/kept.py", "kept\n", 1_700_000_000_000_000_000)
    (src / "z").mkdir()


def test_a_fifo_in_the_source_is_found_before_anything_is_written(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    _old_and_new(src, dst)
    os.mkfifo(src / "z" / "pipe")
    before = _state(dst)
    with pytest.raises(tree_sync.SyncError) as caught:
        tree_sync.sync_tree(src, dst)
    assert _state(dst) == before, "the target was changed before the FIFO was found"
    message = str(caught.value)
    assert str(src / "z" / "pipe") in message and "a FIFO" in message
    assert message.splitlines()[-1].startswith("fix: ")
    os.unlink(src / "z" / "pipe")
    tree_sync.sync_tree(src, dst)
    assert tree_differences(dst, src) == []


def test_an_unreadable_file_is_found_before_anything_is_written(tmp_path: Path) -> None:
    """The sync runs as a user who cannot read one file of the source (root reads anything,
    so as root the test runs it as nobody, in a world-readable directory)."""
    as_root = os.geteuid() == 0
    system_python = shutil.which("python3", path="/usr/bin:/bin") if as_root else sys.executable
    if system_python is None:
        pytest.skip("needs a system python3 to run the sync as user nobody")
    base = Path(tempfile.mkdtemp(prefix="tree-sync-test-", dir="/tmp")) if as_root else tmp_path
    try:
        base.chmod(0o755)
        src, dst = base / "src", base / "dst"
        _old_and_new(src, dst)
        write(src / "z" / "secret.so", "not for you\n").chmod(0o000)
        shutil.copytree(ROOT / "ep_image", base / "ep_image", ignore=PYCACHE)
        as_user: dict = {"capture_output": True, "text": True, "timeout": 120}
        if as_root:
            subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(base)], check=True)
            as_user |= {"user": NOBODY, "group": NOBODY}
        before = _state(dst)

        api = (
            "import sys; sys.path.insert(0, sys.argv[1])\n"
            "from ep_image.build_steps import tree_sync\n"
            "from pathlib import Path\ntry:\n"
            "    tree_sync.sync_tree(Path(sys.argv[2]), Path(sys.argv[3]))\n"
            "except Exception as exc:\n    print(type(exc).__name__, exc); sys.exit(3)"
        )
        proc = subprocess.run([system_python, "-c", api, base, src, dst], **as_user)
        assert proc.returncode == 3, proc.stdout + proc.stderr
        assert _state(dst) == before, "the target was changed before the file was found"
        assert proc.stdout.startswith("SyncError") and "cannot read this file" in proc.stdout

        cli = [system_python, "-m", "ep_image.build_steps.tree_sync", str(src), str(dst)]
        proc = subprocess.run(cli, cwd=base, **as_user)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "Traceback" not in proc.stderr
        assert str(src / "z" / "secret.so") in proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith("fix: ")
        assert _state(dst) == before
    finally:
        if as_root:
            shutil.rmtree(base, ignore_errors=True)


def test_the_quick_check_trusts_size_mtime_mode_and_owner_as_documented(tmp_path: Path) -> None:
    """Equal size, mtime, mode and owner: unchanged, whatever the bytes (rsync's quick check)."""
    t0 = 1_700_000_000_000_000_000
    src, dst = tmp_path / "src", tmp_path / "dst"
    write(src / "f.py", "AAAA\n", t0)
    write(dst / "f.py", "BBBB\n", t0)
    report = tree_sync.sync_tree(src, dst)
    assert report.unchanged == 1 and (dst / "f.py").read_text() == "BBBB\n"
    doc = " ".join((tree_sync.__doc__ or "").split())
    assert "regular files with the same bytes" not in doc, "claims more than it checks"
    assert "same size, mode and owner, and with the same mtime or the same bytes" in doc
    assert "quick check, which reads no bytes" in doc


def test_command_line_help_usage_and_errors(tmp_path: Path) -> None:
    script = [sys.executable, "-m", "ep_image.build_steps.tree_sync"]
    helped = subprocess.run([*script, "--help"], capture_output=True, text=True)
    assert helped.returncode == 0 and "usage: tree_sync " in helped.stdout
    for text in ("SOURCE", "TARGET", "quick check", "FIFO"):
        assert text in helped.stdout, text
    usage = subprocess.run(script, capture_output=True, text=True)
    assert usage.returncode == 2 and "required: SOURCE, TARGET" in usage.stderr
    missing = subprocess.run([*script, tmp_path / "absent", tmp_path / "dst"],
                             capture_output=True, text=True)  # fmt: skip
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    assert missing.stderr.strip().splitlines()[-1].startswith("fix: give an existing directory")
    assert not (tmp_path / "dst").exists()
    write(tmp_path / "src" / "x.py", "x\n")
    done = subprocess.run([*script, tmp_path / "src", tmp_path / "dst"],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0 and "1 files" in done.stdout
    assert tree_differences(tmp_path / "dst", tmp_path / "src") == []


# ---- one tree, two paths: bind mounts ---------------------------------------------------------


@pytest.mark.skipif(mounts.why_not() is not None, reason=str(mounts.why_not()))
@pytest.mark.parametrize(
    ("source", "target", "said"),
    [
        ("big/s", "m", "is inside TARGET"),  # before: emptied big/, its source included
        ("m", "big/s/x", "is inside SOURCE"),  # before: 2,484 entries, then a RecursionError
        ("m/s", "big", "is inside TARGET"),
        ("m", "big", "the same directory"),
        ("big", "m/s/new", "is inside SOURCE"),
    ],
)
def test_the_same_tree_through_a_bind_mount_is_refused(
    tmp_path: Path, source: str, target: str, said: str
) -> None:
    """``m`` is a bind mount of ``big``: the paths differ, the directories are the same."""
    write(tmp_path / "big/s/keep.py", "keep\n")
    write(tmp_path / "big/other.py", "other\n")
    with mounts.bind(tmp_path / "big", tmp_path / "m"):
        before = _state(tmp_path / "big")
        proc = _run(tmp_path / source, tmp_path / target)
        after = _state(tmp_path / "big")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert said in proc.stderr and "nothing was written" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("fix: ")
    if source.startswith("m") != target.startswith("m"):
        assert "by another path" in proc.stderr, "the message says how they are one tree"
    assert after == before, "the tree was changed before the refusal"


def _bound_subdirectory(tmp_path: Path) -> None:
    """``big`` with a subdirectory ``s``, a sibling ``t``, a file of its own, and ``other``."""
    write(tmp_path / "big/keepme", "k\n")
    write(tmp_path / "big/s/f", "f\n")
    write(tmp_path / "big/s/d/g", "g\n")
    write(tmp_path / "big/t/old", "old\n")
    write(tmp_path / "other/o", "o\n")


@pytest.mark.skipif(mounts.why_not() is not None, reason=str(mounts.why_not()))
@pytest.mark.parametrize(
    ("source", "target", "said", "bound"),
    [
        ("s2", "big", "is inside TARGET", "s2"),  # before: big/ emptied, the source's files gone
        ("big", "s2/x", "is inside SOURCE", "s2"),  # before: 2,484 entries, a RecursionError
        ("s2/d", "big", "is inside TARGET", "s2/d"),
        ("big", "s2/d/new", "is inside SOURCE", "s2/d"),
        ("s2", "big/s", "the same directory", None),
    ],
)
def test_a_bind_mount_of_a_subdirectory_is_nested_as_the_kernel_sees_it(
    tmp_path: Path, source: str, target: str, said: str, bound: str | None
) -> None:
    """``s2`` is a bind mount of ``big/s``: no path of ``s2`` lies under ``big``, yet it is
    ``big``'s subdirectory. Refused before anything is written, naming both paths, the other
    path of the bound tree and the fix, with the command's refusal code."""
    _bound_subdirectory(tmp_path)
    with mounts.bind(tmp_path / "big/s", tmp_path / "s2"):
        before = _state(tmp_path / "big")
        proc = _run(tmp_path / source, tmp_path / target)
        after = _state(tmp_path / "big")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "RecursionError" not in proc.stderr
    assert f"{tmp_path / source} " in proc.stderr and f"{tmp_path / target} " in proc.stderr
    assert said in proc.stderr and "nothing was written" in proc.stderr, proc.stderr
    assert "by another path" in proc.stderr, "the message says how they are one tree"
    if bound is not None:  # which directory of the bind mount is which of ``big``
        other = tmp_path / "big/s" / os.path.relpath(bound, "s2")
        assert f"{tmp_path / bound} is also {os.path.normpath(other)}, through a mount" in (
            proc.stderr
        )
    last = proc.stderr.strip().splitlines()[-1]
    assert last == "fix: give two trees" if said == "the same directory" else "bind mount" in last
    assert after == before, "the tree was changed before the refusal"
    assert not (tmp_path / "s2").is_mount() and not list((tmp_path / "s2").iterdir())


@pytest.mark.skipif(mounts.why_not() is not None, reason=str(mounts.why_not()))
@pytest.mark.parametrize(
    ("source", "target"),
    [
        ("s2", "big/t"),  # a sibling of the bound directory, in the same file system
        ("s2", "big/s_other"),  # a name that starts like the bound directory's
        ("big/t", "s2/new"),  # into the bound directory, from its sibling
        ("other", "s2"),  # onto the mount point itself, from another tree
    ],
)
def test_trees_apart_sync_whatever_is_bound_where(tmp_path: Path, source: str, target: str) -> None:
    """A bind mount nearby does not make trees that are apart look nested."""
    _bound_subdirectory(tmp_path)
    with mounts.bind(tmp_path / "big/s", tmp_path / "s2"):
        proc = _run(tmp_path / source, tmp_path / target)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert tree_differences(tmp_path / target, tmp_path / source) == []
    assert (tmp_path / "big/keepme").read_text() == "k\n", "a file beside both trees was touched"
    assert (tmp_path / "other/o").read_text() == "o\n"
    if target != "s2":
        assert (tmp_path / "big/s/f").read_text() == "f\n"


@pytest.mark.skipif(mounts.why_not() is not None, reason=str(mounts.why_not()))
@pytest.mark.parametrize("where", ["target", "source"])
def test_a_mount_point_inside_either_tree_is_refused(tmp_path: Path, where: str) -> None:
    """A mount inside TARGET would be emptied as "only in TARGET"; one inside SOURCE would be
    copied as if it were the source's own: here both are bind mounts of the other tree."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    write(src / "a.py", "a\n")
    write(dst / "b.py", "b\n")
    inner, other = (dst / "held", src) if where == "target" else (src / "held", dst)
    with mounts.bind(other, inner):
        before = (_state(src), _state(dst))
        proc = _run(src, dst)
        assert (_state(src), _state(dst)) == before, "a tree was changed before the refusal"
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "mount point" in proc.stderr and "nothing was written" in proc.stderr, proc.stderr
    assert str(inner) in proc.stderr


# ---- names that look like tree_sync's own -----------------------------------------------------


def test_files_named_like_its_temporary_files_are_copied_like_any_other(tmp_path: Path) -> None:
    """A venv may hold ``x`` and ``x.tree-sync-tmp`` side by side; both reach the target, with
    their own bytes (before: 6 of 8 such pairs lost a file, and the run exited 0)."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    for i in range(8):
        write(src / f"pkg{i % 2}/f{i}.py", f"the file {i}\n")
        write(src / f"pkg{i % 2}/f{i}.py.tree-sync-tmp", f"its neighbour {i}, a file too\n")
        write(dst / f"pkg{i % 2}/f{i}.py", f"last build's file {i}, longer\n")
    proc = _run(src, dst)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert tree_differences(dst, src) == []
    assert tree_sync.sync_tree(src, dst).files_written == 0


def test_another_users_file_is_refused_up_front_and_no_temporary_file_is_left() -> None:
    """As a user who is not root, a source file of another user cannot be copied with its
    owner (chown needs root): refused before anything is written, naming the file and the fix
    (before: 'make TARGET writable', and ``f.tree-sync-tmp`` left in the target)."""
    as_root = os.geteuid() == 0
    system_python = shutil.which("python3", path="/usr/bin:/bin")
    if not as_root or system_python is None:
        pytest.skip("needs root (to own a file another user syncs) and a system python3")
    base = Path(tempfile.mkdtemp(prefix="tree-sync-test-", dir="/tmp"))
    try:
        base.chmod(0o755)
        src, dst = base / "src", base / "dst"
        _old_and_new(src, dst)
        shutil.copytree(ROOT / "ep_image", base / "ep_image", ignore=PYCACHE)
        subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(base)], check=True)
        roots = write(src / "z" / "roots.so", "root's, readable by all\n")
        os.chown(roots, 0, 0)
        roots.chmod(0o644)
        before = _state(dst)
        cli = [system_python, "-m", "ep_image.build_steps.tree_sync", str(src), str(dst)]
        proc = subprocess.run(
            cli, cwd=base, capture_output=True, text=True, timeout=120, user=NOBODY, group=NOBODY
        )
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "Traceback" not in proc.stderr
        assert str(roots) in proc.stderr and "uid 0" in proc.stderr, proc.stderr
        assert "make TARGET writable" not in proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith("fix: "), proc.stderr
        assert "root" in proc.stderr.strip().splitlines()[-1]
        assert _state(dst) == before
        assert not list(dst.rglob("*tree-sync*")), "a temporary file was left in the target"
    finally:
        shutil.rmtree(base, ignore_errors=True)
