"""dedup treats as its own only what it made and recorded; it reads back what it did.

Why: a venv may hold a file named like a temporary of hardlink's (``X.hardlink-temporary``) or
of an older dedup (``.dedup-tmp-*``), and one run may link such a file to its twin; deleting it
"as a leftover of a killed run" loses a file. A hardlink killed mid-run prints none of the links
it made (its output is buffered), so what was linked is read back from the trees. The same tree
given twice through a bind mount is one tree, not a second dedup run. A journal entry swapped
for a symbolic link while the run gives modes back is a file no longer there, not a crash.

Real trees, the real util-linux hardlink, real SIGKILLs at exact moments (tests/_fault_inject.py)
and real bind mounts (tests/_mounts.py).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _mounts as mounts
import pytest
from _fault_inject import faulty_env
from _venv_helpers import inodes, run_dedup, snapshot

from ep_image.build_steps.dedup.report import Report
from ep_image.build_steps.dedup.tree import TEMP_SUFFIX

TEMP = TEMP_SUFFIX


def pair_of_trees(base: Path, files: int = 40, size: int = 64 << 10) -> tuple[Path, Path]:
    """Two trees holding the same ``files`` files (each its own bytes), as separate copies."""
    a, b = base / "a", base / "b"
    for root in (a, b):
        (root / "pkg").mkdir(parents=True)
        for i in range(files):
            (root / "pkg" / f"f{i:03d}.so").write_bytes(bytes([i % 251 + 1]) * size)
    return a, b


def state(*roots: Path) -> dict[str, tuple[str, int]]:
    return {f"{r.name}/{k}": v for r in roots for k, v in snapshot(r).items()}


def ids(*roots: Path) -> dict[str, tuple[int, int]]:
    return {f"{r.name}/{k}": v for r in roots for k, v in inodes(r).items()}


def linked_since(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> int:
    """Paths that now hold another path's inode of before: what was linked, read back."""
    known = set(before.values())
    return sum(1 for p, i in after.items() if p in before and i != before[p] and i in known)


def report_of(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


# ---- names like dedup's and hardlink's temporaries ---------------------------------------------


def test_files_named_like_temporaries_are_never_deleted(tmp_path: Path) -> None:
    """A file named ``X.hardlink-temporary`` (or ``.dedup-tmp-*``) beside X with two links is a
    user's file: before, it was deleted as "a temporary link of a killed run" without even
    being compared with X; and a copy of Y named ``Y.hardlink-temporary``, linked to Y by one
    run, was deleted by the next."""
    a, b = pair_of_trees(tmp_path, files=4)
    (a / "X").write_bytes(b"x" * 5000)
    (a / f"X{TEMP}").write_bytes(b"not X" * 1000)
    os.link(a / f"X{TEMP}", b / "second-name")
    (a / ".dedup-tmp-0abc12-7").write_bytes(b"legacy" * 1000)
    (a / ".dedup-tmp-0abc12").write_bytes(b"x" * 5000)  # X's bytes, under the old prefix
    os.link(a / ".dedup-tmp-0abc12-7", b / "legacy-second-name")
    (a / "Y").write_bytes(b"y" * 5000)
    (a / f"Y{TEMP}").write_bytes(b"y" * 5000)
    before = state(a, b)
    for run in range(2):
        out = tmp_path / f"run{run}.json"
        proc = run_dedup("--json", out, a, b)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert report_of(out)["stale_temps_removed"] == 0, f"run {run} removed a user's file"
        assert state(a, b) == before, f"run {run} lost or changed a file"
    assert (a / "Y").stat().st_ino == (a / f"Y{TEMP}").stat().st_ino, "copies are still linked"


def test_a_killed_hardlink_is_read_back_and_its_temporary_link_removed(
    tmp_path: Path, shim: Path
) -> None:
    """hardlink SIGKILLed between its 11th temporary link and the rename: dedup reads back the
    10 links it made (before: "linked 0 ... removed by another process 10", its records lost in
    its output buffer) and removes the one temporary link it left, in the same run."""
    a, b = pair_of_trees(tmp_path)
    before_state, before_ids = state(a, b), ids(a, b)
    out = tmp_path / "report.json"
    proc = run_dedup("--json", out, a, b, env=faulty_env(shim, EP_FAULT_KILL_AT_RENAME="10"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "killed by SIGKILL" in proc.stderr and "Traceback" not in proc.stderr
    report = report_of(out)
    linked = linked_since(before_ids, ids(a, b))
    assert linked == 10, "the fault happened after 10 links"
    assert report["files_linked"] == linked, report
    assert not any("another process" in reason for reason in report["skipped"]), report
    assert report["stale_temps_removed"] == 1
    assert not list(tmp_path.rglob(f"*{TEMP}")), "the temporary link was left"
    assert state(a, b) == before_state, "a path lost its bytes or mode"
    again = tmp_path / "again.json"
    assert run_dedup("--json", again, a, b).returncode == 0
    assert report_of(again)["files_linked"] == 30


def test_a_run_killed_with_its_hardlink_is_finished_by_the_next(tmp_path: Path, shim: Path) -> None:
    """The whole command killed (a CI timeout kills dedup and hardlink alike): the temporary
    link is left with dedup's record of the run, and only the next run, reading that record,
    removes it."""
    a, b = pair_of_trees(tmp_path)
    before = state(a, b)
    real = shutil.which("hardlink")
    assert real
    wrapper = tmp_path / "bin" / "hardlink"
    wrapper.parent.mkdir()
    wrapper.write_text(
        "#!/bin/sh\n"
        f'case "$1" in --version) exec {real} "$@" ;; esac\n'
        f'LD_PRELOAD={shim} EP_FAULT_KILL_AT_RENAME=10 {real} "$@"\n'
        "kill -9 $PPID\n"
    )
    wrapper.chmod(0o755)
    env = {**os.environ, "PATH": f"{wrapper.parent}:{os.environ['PATH']}"}
    proc = run_dedup(a, b, env=env)
    assert proc.returncode == -9, proc.stdout + proc.stderr
    left = list(tmp_path.rglob(f"*{TEMP}"))
    assert len(left) == 1, left
    out = tmp_path / "report.json"
    proc = run_dedup("--json", out, a, b)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report_of(out)["stale_temps_removed"] == 1
    assert not list(tmp_path.rglob(f"*{TEMP}"))
    assert not [p for r in (a, b) for p in r.iterdir() if p.name.startswith(".dedup-")]
    assert state(a, b) == before


# ---- the same tree twice -------------------------------------------------------------------------


@pytest.mark.skipif(mounts.why_not() is not None, reason=str(mounts.why_not()))
@pytest.mark.parametrize("given", [("a", "m"), ("a", "m/sub")])
def test_a_root_reached_twice_through_a_bind_mount_is_one_root(
    tmp_path: Path, given: tuple[str, str]
) -> None:
    """``m`` is a bind mount of ``a``, so ``m`` is ``a`` and ``m/sub`` a tree inside it: before,
    the second path's lock collided with the first's and the run said "another dedup run is
    working on" it, when none was."""
    a, b = pair_of_trees(tmp_path, files=4)
    (a / "sub").mkdir()
    (a / "sub" / "copy.so").write_bytes((a / "pkg" / "f000.so").read_bytes())
    with mounts.bind(a, tmp_path / "m"):
        out = tmp_path / "report.json"
        proc = run_dedup("--json", out, tmp_path / given[0], tmp_path / given[1], b)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "another dedup run" not in proc.stderr
    assert report_of(out)["roots"] == [str(a), str(b)]
    assert (a / "pkg" / "f000.so").stat().st_ino == (b / "pkg" / "f000.so").stat().st_ino
    assert (a / "sub" / "copy.so").stat().st_ino == (b / "pkg" / "f000.so").stat().st_ino


@pytest.mark.skipif(mounts.why_not() is not None, reason=str(mounts.why_not()))
def test_roots_on_two_mounts_of_one_filesystem_are_refused(tmp_path: Path) -> None:
    """``b`` and ``m`` (a bind mount of ``a``) share a device, but link(2) cannot cross mounts:
    before, every link failed with "Invalid cross-device link" and the run said to run again,
    which fails the same way. Now it is refused before anything changes, naming both mounts."""
    a, b = pair_of_trees(tmp_path, files=4)
    with mounts.bind(a, tmp_path / "m"):
        before = ids(a, b)
        proc = run_dedup(tmp_path / "m", b)
        assert ids(a, b) == before
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "different mounts" in proc.stderr and str(tmp_path / "m") in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("dedup: fix: ")


# ---- a journal entry swapped while modes are given back --------------------------------------


def test_a_journal_entry_swapped_for_a_link_mid_restore_is_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Right after dedup looks at a listed file, the file is moved aside and a symbolic link to
    a file outside the ROOT put in its place. Before: os.chmod(follow_symlinks=False) on the
    link raised NotImplementedError and the run ended in a traceback. Now the file is opened
    once, checked and changed through that one descriptor: the inode the journal named gets
    its mode back wherever it is now, and the link is never followed or changed."""
    from ep_image.build_steps.dedup.read_only import MODES_JOURNAL, restore_journals

    root = tmp_path / "root"
    root.mkdir()
    outside = tmp_path / "outside.so"
    outside.write_text("not dedup's\n")
    outside.chmod(0o444)
    entries = []
    for i in range(5):
        path = root / f"f{i}.so"
        path.write_text(f"{i}\n")
        path.chmod(0o444)  # as a killed --read-only run left it: 0644 less its write bits
        st = path.stat()
        entries.append([path.name, st.st_dev, st.st_ino, 0o644])
    journal = root / MODES_JOURNAL
    journal.write_text(json.dumps({"modes": entries}))
    journal.chmod(0o600)
    swapped, aside = root / "f2.so", root / "moved-aside"
    real: dict[str, Callable[..., Any]] = {"lstat": os.lstat, "open": os.open, "stat": os.stat}

    def swap_after(name: str) -> Callable[..., Any]:
        def wrapped(path: Any, *args: Any, **kwargs: Any) -> Any:
            result = real[name](path, *args, **kwargs)
            named = isinstance(path, (str, Path)) and Path(path).name == swapped.name
            if named and not os.path.lexists(aside):
                os.rename(swapped, aside)
                os.symlink(outside, swapped)
            return result

        return wrapped

    for name in real:
        monkeypatch.setattr(os, name, swap_after(name))
    report = Report(roots=[str(root)], device=root.stat().st_dev, dry_run=False, read_only=False)
    try:
        restore_journals([root], report, dry_run=False)
    finally:
        monkeypatch.undo()
    assert swapped.is_symlink(), "the swap happened"
    assert stat.S_IMODE(outside.stat().st_mode) == 0o444, "the link was followed"
    assert report.modes_restored == 5 and report.failures == [], report
    assert stat.S_IMODE(aside.stat().st_mode) == 0o644, "the inode it named was not restored"
    for i in (0, 1, 3, 4):
        assert stat.S_IMODE((root / f"f{i}.so").stat().st_mode) == 0o644
