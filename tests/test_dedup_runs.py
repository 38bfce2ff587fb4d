"""ep_image/build_steps/dedup/ when a run does not go as planned: killed, a ROOT or a file
removed under it, a bad argument, odd names, inodes shared with the world outside the ROOTs.

Each test runs dedup.py as a subprocess on real trees, with the real util-linux hardlink, and
checks the trees themselves (modes, inodes, `du`) against the report. Where something must
happen at one exact moment of a run (a kill after the write bits are cleared, a ROOT removed
while hardlink runs), a test puts a `hardlink` wrapper first on PATH: a shell script that runs
the real tool and does the test's step before or after it (``wrapped_hardlink``). That wrapper
is the only stand-in: dedup.py is unchanged and has no test hook; a kill is a real SIGKILL to
the real process group.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _venv_helpers import (
    PYCACHE,
    ROOT,
    dedup_json,
    du_total,
    inodes,
    make_uv_venv,
    run_dedup,
    snapshot,
)

from ep_image.build_steps.dedup.report import Report

PACKAGES = ("six==1.17.0", "packaging==26.4")
TRACEBACK = "Traceback"
JOURNAL = ".dedup-read-only-modes.json"  # docs/host-mode.md names it
NOBODY = 65534


def modes(root: Path) -> dict[str, int]:
    return {rel: mode for rel, (_sha, mode) in snapshot(root).items()}


def wrapped_hardlink(directory: Path, *, before: str = "", after: str = "") -> dict[str, str]:
    """An environment whose `hardlink` runs shell ``before``, the real tool, then ``after``."""
    real = shutil.which("hardlink")
    assert real, "util-linux hardlink is needed (it is an essential package)"
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "hardlink"
    script.write_text(
        "#!/bin/sh\n"
        f'case "$1" in --version) exec {real} "$@" ;; esac\n'
        f"{before}\n"
        f'{real} "$@"\n'
        "rc=$?\n"
        f"{after}\n"
        "exit $rc\n"
    )
    script.chmod(0o755)
    return {**os.environ, "PATH": f"{directory}:{os.environ['PATH']}"}


def wait_for(path: Path, proc: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None, "dedup ended before the moment the test waits for"
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.02)


def kill_dedup_at(marker: Path, env: dict[str, str], *args: str) -> None:
    """Run dedup with ``args`` and SIGKILL its whole session the moment ``marker`` appears (a
    wrapped tool writes it): the state a killed run leaves, for the next run to undo."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ep_image.build_steps.dedup", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for(marker, proc)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


@pytest.fixture
def venvs(tmp_path: Path) -> tuple[Path, Path]:
    """Two real venvs holding the same small packages, as separate copies, and each a few
    files of its own (in real venvs: every file of the one backend's distribution)."""
    a = make_uv_venv(tmp_path / "a", *PACKAGES)
    b = make_uv_venv(tmp_path / "b", *PACKAGES)
    for root, name, mode in ((a, "own_a.so", 0o644), (b, "own_b.cfg", 0o600)):
        (root / name).write_bytes(os.urandom(3000))
        (root / name).chmod(mode)
    (a / "lib_a").mkdir()
    (a / "lib_a" / "kernel.py").write_text("A = 1\n" * 300)
    (a / "lib_a" / "kernel.py").chmod(0o664)
    return a, b


# --------------------------------------------------------------------------- --read-only killed


def plant_journal(root: Path, entries: list[list[object]], mode: int = 0o600) -> Path:
    """A journal as dedup writes it, but with ``entries`` chosen by whoever can write ROOT."""
    journal = root / JOURNAL
    journal.write_text(json.dumps({"modes": entries}))
    journal.chmod(mode)
    return journal


def victim(tmp_path: Path) -> tuple[Path, list[object]]:
    """A read-only file outside the ROOTs, and a journal entry naming it through ``..``."""
    target = tmp_path / "outside" / "V"
    target.parent.mkdir()
    target.write_text("not yours\n")
    target.chmod(0o440)
    st = target.stat()
    return target, [f"../outside/{target.name}", st.st_dev, st.st_ino, 0o662]


def test_a_journal_entry_pointing_out_of_its_root_is_refused(venvs, tmp_path: Path) -> None:
    """The attack: whoever can write a ROOT plants an entry ``["../V", dev, ino, 0o662]``; a
    dedup run (as root, say) must not give "back" write bits to a file outside the ROOTs."""
    a, b = venvs
    target, entry = victim(tmp_path)
    entry[0] = os.path.relpath(target, a)
    plant_journal(a, [entry])
    proc = run_dedup(a, b)
    assert stat.S_IMODE(target.stat().st_mode) == 0o440
    assert "entries name no file dedup could have recorded" in proc.stderr, proc.stderr
    assert proc.returncode == 1
    assert not (a / JOURNAL).exists()  # handled: the next run has nothing to read


def test_a_journal_entry_through_a_symbolic_link_is_refused(venvs, tmp_path: Path) -> None:
    a, b = venvs
    target, entry = victim(tmp_path)
    (a / "escape").symlink_to(target.parent)
    entry[0] = f"escape/{target.name}"
    plant_journal(a, [entry])
    proc = run_dedup(a, b)
    assert stat.S_IMODE(target.stat().st_mode) == 0o440, proc.stderr
    assert "entries name no file dedup could have recorded" in proc.stderr


def _restore(root: Path) -> Report:
    from ep_image.build_steps.dedup.read_only import restore_journals

    report = Report(roots=[str(root)], device=root.stat().st_dev, dry_run=False, read_only=False)
    restore_journals([root], report, dry_run=False)
    return report


def test_a_journal_swapped_for_a_symbolic_link_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """dedup checked the journal by path (lstat), then read it by path: swapped for a symbolic
    link in between, it acted on the entries of a file anyone could write. Now it opens the
    journal once without following a link, checks and reads that one file: a link in its place
    is refused, and a swap after the open reads nothing new."""
    root = tmp_path / "root"
    root.mkdir()
    inside = root / "own.so"
    inside.write_text("x\n")
    inside.chmod(0o444)
    st = inside.stat()
    planted = tmp_path / "planted.json"  # entries whoever can write it chose
    planted.write_text(json.dumps({"modes": [["own.so", st.st_dev, st.st_ino, 0o666]]}))
    planted.chmod(0o600)

    (root / JOURNAL).symlink_to(planted)
    report = _restore(root)
    assert stat.S_IMODE(inside.stat().st_mode) == 0o444
    assert any("refused, it is a symbolic link" in f for f in report.failures), report.failures
    (root / JOURNAL).unlink()  # a refused journal is left for its owner to look at

    # The journal dedup wrote (0600, this user's), swapped for a link the moment it is looked at.
    genuine = plant_journal(root, [["own.so", st.st_dev, st.st_ino, 0o644]])
    link = tmp_path / "link"
    link.symlink_to(planted)
    real_lstat, real_open = os.lstat, os.open

    def swap_after(call: Callable[..., Any]) -> Callable[..., Any]:  # os.lstat or os.open
        def wrapped(path: str | Path, *args: Any, **kwargs: Any) -> Any:
            result = call(path, *args, **kwargs)
            if os.fspath(path) == str(genuine) and link.is_symlink():
                os.replace(link, genuine)
            return result

        return wrapped

    monkeypatch.setattr(os, "lstat", swap_after(real_lstat))
    monkeypatch.setattr(os, "open", swap_after(real_open))
    report = _restore(root)
    monkeypatch.undo()
    assert not link.is_symlink(), "the journal was never looked at"
    assert stat.S_IMODE(inside.stat().st_mode) == 0o644, "the planted entry was acted on"
    assert report.modes_restored == 1 and report.failures == []


@pytest.mark.skipif(os.geteuid() != 0, reason="giving the journal to another user needs root")
@pytest.mark.parametrize("how", ["another user's", "writable by others"])
def test_a_journal_someone_else_could_have_written_is_not_acted_on(
    venvs, tmp_path: Path, how: str
) -> None:
    """Even an entry inside the ROOT: a journal dedup did not write (another owner, or one
    anyone could have rewritten) changes no mode."""
    a, b = venvs
    inside = a / "own_a.so"
    inside.chmod(0o444)
    st = inside.stat()
    journal = plant_journal(
        a,
        [["own_a.so", st.st_dev, st.st_ino, 0o666]],
        0o666 if how == "writable by others" else 0o600,
    )
    if how == "another user's":
        os.chown(journal, NOBODY, NOBODY)
    proc = run_dedup(a, b)
    assert stat.S_IMODE(inside.stat().st_mode) == 0o444
    assert "refused" in proc.stderr and "may have been planted" in proc.stderr, proc.stderr
    assert proc.returncode == 1


def test_the_journal_dedup_writes_is_owner_only(venvs, tmp_path: Path) -> None:
    """What makes its own journal trusted: written 0600, by this user (seen mid-run)."""
    a, b = venvs
    marker = tmp_path / "seen"
    env = wrapped_hardlink(tmp_path / "wrap", before=f"stat -c '%a %u' {a / JOURNAL} > {marker}")
    proc = subprocess.run(
        [sys.executable, "-m", "ep_image.build_steps.dedup", "--read-only", str(a), str(b)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert marker.read_text().split() == ["600", str(os.geteuid())]


def test_read_only_killed_after_clearing_write_bits_is_undone_by_the_next_run(
    venvs, tmp_path: Path
) -> None:
    """SIGKILL to the whole run after the write bits are cleared and hardlink has linked.

    The next run gives every file that stays unshared its mode back (0644, 0600, 0664 here);
    shared ones end read-only, as a run that was never killed leaves them.
    """
    a, b = venvs
    before = {"a": modes(a), "b": modes(b)}
    marker = tmp_path / "hardlink-finished"
    env = wrapped_hardlink(tmp_path / "wrap", after=f"touch {marker}; sleep 600")
    kill_dedup_at(marker, env, "--read-only", str(a), str(b))

    # The state a kill leaves: files of one venv only, without their write bits.
    assert stat.S_IMODE((a / "own_a.so").stat().st_mode) == 0o444
    assert stat.S_IMODE((b / "own_b.cfg").stat().st_mode) == 0o400

    report = dedup_json(tmp_path, a, b, extra=("--read-only",))

    for name, root in (("a", a), ("b", b)):
        ids = inodes(root)
        shared = {rel for rel, ino in ids.items() if _links_here(ino, a, b) > 1}
        for rel, mode in modes(root).items():
            if rel in shared:
                assert mode & 0o222 == 0, f"{name}/{rel} is shared and writable"
            else:
                assert mode == before[name][rel], f"{name}/{rel}: {oct(mode)}"
    assert stat.S_IMODE((b / "own_b.cfg").stat().st_mode) == 0o600
    assert report["modes_restored"] >= 3
    assert not list(tmp_path.rglob(JOURNAL + "*"))


def _links_here(ino: tuple[int, int], *roots: Path) -> int:
    return sum(list(inodes(root).values()).count(ino) for root in roots)


def test_a_plain_run_after_a_killed_read_only_run_gives_the_modes_back(tmp_path: Path) -> None:
    """The journal is read by any real run, --read-only or not; a dry run only reports it."""
    a, b = tmp_path / "a", tmp_path / "b"
    for root in (a, b):
        root.mkdir()
        (root / "same.bin").write_bytes(b"s" * 5000)
    (a / "only.bin").write_bytes(b"o" * 5000)
    (a / "only.bin").chmod(0o640)
    marker = tmp_path / "hardlink-started"
    env = wrapped_hardlink(tmp_path / "wrap", before=f"touch {marker}; sleep 600")
    kill_dedup_at(marker, env, "--read-only", str(a), str(b))
    assert stat.S_IMODE((a / "only.bin").stat().st_mode) == 0o440
    assert stat.S_IMODE((b / "same.bin").stat().st_mode) == 0o444

    dry = dedup_json(tmp_path, a, b, extra=("--dry-run",))
    assert stat.S_IMODE((a / "only.bin").stat().st_mode) == 0o440, "a dry run changes nothing"

    report = dedup_json(tmp_path, a, b)
    assert stat.S_IMODE((a / "only.bin").stat().st_mode) == 0o640
    assert stat.S_IMODE((b / "same.bin").stat().st_mode) == 0o644
    assert (a / "same.bin").stat().st_ino == (b / "same.bin").stat().st_ino
    assert not (a / JOURNAL).exists()
    assert dry["modes_restored"] == report["modes_restored"] == 3


# --------------------------------------------------------------------------- things that vanish


def _small_trees(tmp_path: Path) -> tuple[Path, Path]:
    a, b = tmp_path / "a", tmp_path / "b"
    for root in (a, b):
        (root / "lib").mkdir(parents=True)
        (root / "lib" / "dup1.bin").write_bytes(b"1" * 20000)
        (root / "lib" / "dup2.bin").write_bytes(b"2" * 30000)
    return a, b


def test_a_root_that_vanishes_mid_run_is_reported_not_a_traceback(tmp_path: Path) -> None:
    """Another process removes ROOT b while hardlink runs: a report, exit 1, nothing counted."""
    a, b = _small_trees(tmp_path)
    report_path = tmp_path / "report.json"
    env = wrapped_hardlink(tmp_path / "wrap", before=f"rm -rf {b}")

    proc = run_dedup("--json", report_path, a, b, env=env)

    assert TRACEBACK not in proc.stderr, proc.stderr
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "vanished" in proc.stderr and str(b) in proc.stderr
    assert last_line(proc.stderr).startswith("dedup: fix:")
    report = json.loads(report_path.read_text())
    assert any(str(b) in f and "vanished" in f for f in report["failures"])
    assert (report["files_linked"], report["inodes_merged"], report["saved_bytes"]) == (0, 0, 0)
    assert report["du_bytes_after"] == du_total(a)


def test_files_removed_by_someone_else_are_not_counted_as_linked_or_saved(
    tmp_path: Path,
) -> None:
    """After hardlink linked, another process deletes a replaced path and a file of its own.

    b's dup2 has a second name, so hardlink keeps it (--maximize) and replaces a's: the path
    deleted is the replaced one. Counted (read back from the trees): only the link that is
    still there (dup1), and only the copy it replaced as freed.
    """
    a, b = _small_trees(tmp_path)
    os.link(b / "lib/dup2.bin", b / "dup2-second-name.bin")
    victim = b / "unique.bin"
    victim.write_bytes(os.urandom(1 << 20))
    env = wrapped_hardlink(tmp_path / "wrap", after=f"rm -f {victim} {a}/lib/dup2.bin")
    report_path = tmp_path / "report.json"

    proc = run_dedup("--json", report_path, a, b, env=env)

    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(report_path.read_text())
    assert (a / "lib/dup1.bin").stat().st_ino == (b / "lib/dup1.bin").stat().st_ino
    assert report["files_linked"] == 1, "a deleted path is not a link"
    assert report["inodes_merged"] == 1
    one_copy = (a / "lib/dup1.bin").stat().st_blocks * 512
    assert report["saved_bytes"] == one_copy, "the deleted megabyte is not dedup's saving"
    assert report["du_bytes_after"] == du_total(a, b)
    assert sum(v for k, v in report["skipped"].items() if "another process" in k) == 2


# --------------------------------------------------------------------------- arguments


def test_json_path_that_cannot_be_written_is_refused_before_linking(tmp_path: Path) -> None:
    a, b = _small_trees(tmp_path)
    (tmp_path / "a-file").write_text("not a directory\n")
    state = inodes(a), inodes(b)

    proc = run_dedup("--json", tmp_path / "a-file" / "r.json", a, b)

    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert TRACEBACK not in proc.stderr
    assert last_line(proc.stderr).startswith("dedup: usage error: argument --json")
    assert "give a path in a directory you can write" in last_line(proc.stderr)
    assert (inodes(a), inodes(b)) == state, "files were linked before the refusal"

    # A directory that does not exist yet is made, as the probes' --json does.
    report = tmp_path / "no" / "such" / "dir" / "r.json"
    proc = run_dedup("--json", report, a, b)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(report.read_text())["files_linked"] == 2
    assert [p.name for p in report.parent.iterdir()] == ["r.json"], "no temporary file left"


@pytest.mark.parametrize("value", ["-5", "ten", "1.5"])
def test_bad_min_size_is_a_usage_error(tmp_path: Path, value: str) -> None:
    a, b = _small_trees(tmp_path)
    state = inodes(a), inodes(b)
    proc = run_dedup("--min-size", value, a, b)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "hardlink" not in proc.stderr and TRACEBACK not in proc.stderr
    assert "--min-size" in last_line(proc.stderr) and "0 or more" in last_line(proc.stderr)
    assert (inodes(a), inodes(b)) == state


def test_dry_run_predicts_the_run_for_names_with_newlines(tmp_path: Path) -> None:
    """hardlink prints names raw: a link record of a name with a newline spans lines."""
    a, b = tmp_path / "a", tmp_path / "b"
    names = ["nl\nname.so", "two\n\nlines.txt", "cr\rname.so", "x to y.so", "to\n to .so"]
    for i, name in enumerate(names):
        for root in (a, b):
            (root / "lib").mkdir(parents=True, exist_ok=True)
            (root / "lib" / name).write_bytes(bytes([65 + i]) * (5000 + 1000 * i))
    state = inodes(a), inodes(b)

    dry = dedup_json(tmp_path, a, b, extra=("--dry-run",))
    assert (inodes(a), inodes(b)) == state
    real = dedup_json(tmp_path, a, b)

    for name in names:
        assert (a / "lib" / name).stat().st_ino == (b / "lib" / name).stat().st_ino, name
    keys = ("files_linked", "inodes_merged", "bytes_after", "du_bytes_after", "saved_bytes")
    assert {k: dry[k] for k in keys} == {k: real[k] for k in keys}
    assert real["files_linked"] == len(names)


# --------------------------------------------------------------------------- linked from outside


def test_read_only_keeps_copies_linked_from_outside_apart(tmp_path: Path) -> None:
    """Each venv's copy also lives in a cache (uv's link mode "hardlink"): under --read-only
    neither can be made read-only, so they must not be linked to each other either."""
    a, b, cache_a, cache_b = (tmp_path / n for n in ("a", "b", "cache_a", "cache_b"))
    for d in (a, b, cache_a, cache_b):
        d.mkdir()
    payload = b"\x7fELF" + os.urandom(20000)
    for cache, root in ((cache_a, a), (cache_b, b)):
        (cache / "lib.so").write_bytes(payload)
        os.link(cache / "lib.so", root / "lib.so")
    for root in (a, b):
        (root / "own.py").write_text("x = 1\n" * 100)

    proc = run_dedup("--read-only", "--json", tmp_path / "r.json", a, b)

    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert (a / "lib.so").stat().st_ino != (b / "lib.so").stat().st_ino, "linked to each other"
    for cache in (cache_a, cache_b):
        assert (cache / "lib.so").stat().st_mode & 0o200, "the cache's file keeps its mode"
        assert (cache / "lib.so").stat().st_nlink == 2
    assert (a / "own.py").stat().st_ino == (b / "own.py").stat().st_ino
    assert (a / "own.py").stat().st_mode & 0o222 == 0
    kept_apart = [k for k in report["skipped"] if "linked from outside" in k]
    assert [report["skipped"][k] for k in kept_apart] == [2]
    assert sum(report["left_writable"].values()) == 2
    assert "left writable (--read-only): also linked from outside" in proc.stdout

    # Without --read-only they may share (nothing is freed: both stay in their caches).
    report = dedup_json(tmp_path, a, b)
    assert (a / "lib.so").stat().st_ino == (b / "lib.so").stat().st_ino
    assert report["saved_bytes"] == 0 and report["shared_not_freed_bytes"] > 0


# --------------------------------------------------------------------------- metadata writes


def test_chmod_and_touch_reach_every_venv_that_shares_the_inode(tmp_path: Path) -> None:
    """Not only writes into the bytes: an inode has one mode and one mtime. docs/host-mode.md
    lists these beside strip, patchelf and `>>`."""
    a, b = _small_trees(tmp_path)
    dedup_json(tmp_path, a, b)
    target_a, target_b = a / "lib/dup1.bin", b / "lib/dup1.bin"
    os.chmod(target_a, 0o600)
    assert stat.S_IMODE(target_b.stat().st_mode) == 0o600
    os.utime(target_a, (1_000_000_000, 1_000_000_000))
    assert target_b.stat().st_mtime == 1_000_000_000
    subprocess.run(["touch", str(target_a)], check=True)
    assert target_b.stat().st_mtime > 1_000_000_000
    if os.geteuid() == 0:  # giving a file away needs root
        os.chown(target_a, 12345, -1)
        assert target_b.stat().st_uid == 12345
    os.setxattr(target_a, "user.ep-test", b"1")
    assert os.getxattr(target_b, "user.ep-test") == b"1"


@pytest.mark.skipif(
    not (shutil.which("cc") and shutil.which("strip")),
    reason="needs cc and binutils' strip: python3 -m ep_image.build.bootstrap --tests installs gcc",
)
def test_strip_and_append_write_through_a_shared_inode_and_a_rename_does_not(
    tmp_path: Path,
) -> None:
    """The writes into the bytes: binutils' `strip` copies its result over a file with several
    links instead of renaming it, and `>>` appends in place, so both change every venv's link;
    a new file renamed over the old one (`cp f f.new && strip f.new && mv f.new f`) changes only
    the venv it was run in."""
    a, b = _small_trees(tmp_path)
    for name, body in (("x.so", "return x + 1;"), ("y.so", "return x + 2;")):
        source = tmp_path / f"{name}.c"
        source.write_text(f"int f(int x) {{ {body} }}\n")
        built = tmp_path / name
        subprocess.run(["cc", "-g", "-shared", "-fPIC", "-o", built, source], check=True)
        for root in (a, b):
            shutil.copy2(built, root / "lib" / name)
    dedup_json(tmp_path, a, b)
    for name in ("x.so", "y.so", "dup1.bin"):
        assert (a / "lib" / name).stat().st_ino == (b / "lib" / name).stat().st_ino, name

    unstripped = (b / "lib/x.so").read_bytes()
    subprocess.run(["strip", a / "lib/x.so"], check=True)
    assert (a / "lib/x.so").read_bytes() != unstripped
    assert (b / "lib/x.so").read_bytes() == (a / "lib/x.so").read_bytes()

    subprocess.run(["sh", "-c", 'echo x >> "$1"', "sh", a / "lib/dup1.bin"], check=True)
    assert (b / "lib/dup1.bin").read_bytes().endswith(b"x\n")

    mine, theirs = a / "lib/y.so", b / "lib/y.so"
    before = theirs.read_bytes()
    recipe = 'cp "$1" "$1.new" && strip "$1.new" && mv "$1.new" "$1"'
    subprocess.run(["sh", "-c", recipe, "sh", mine], check=True)
    assert mine.read_bytes() != before and theirs.read_bytes() == before
    assert mine.stat().st_ino != theirs.stat().st_ino


# --------------------------------------------------------------------------- dedup.books


def test_dedup_books_has_a_command_line_whose_figures_are_dus(tmp_path: Path) -> None:
    a, b = _small_trees(tmp_path)
    os.link(a / "lib/dup1.bin", b / "lib/extra.bin")
    script = [sys.executable, "-m", "ep_image.build_steps.dedup.books"]
    helped = subprocess.run([*script, "--help"], capture_output=True, text=True)
    assert helped.returncode == 0 and "usage: dedup.books " in helped.stdout
    assert "du -sxcB1" in helped.stdout

    proc = subprocess.run([*script, "--json", a, b], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(proc.stdout)
    assert figures["du_bytes"] == du_total(a, b)
    assert (figures["files_scanned"], figures["inodes"], figures["inodes_shared_here"]) == (
        5,
        4,
        1,
    )

    bad = subprocess.run([*script, tmp_path / "missing"], capture_output=True, text=True)
    assert bad.returncode == 2 and TRACEBACK not in bad.stderr
    assert "give existing trees" in last_line(bad.stderr)


def test_read_only_refuses_a_root_it_cannot_record_modes_in(tmp_path: Path) -> None:
    """--read-only writes its journal into each ROOT before it clears a bit: where it cannot,
    nothing is changed (as root the test runs dedup as nobody on root's trees)."""
    as_root = os.geteuid() == 0
    python = shutil.which("python3", path="/usr/bin:/bin") if as_root else sys.executable
    if python is None:
        pytest.skip("needs a system python3 to run dedup as user nobody")
    base = Path(tempfile.mkdtemp(prefix="dedup-test-", dir="/tmp")) if as_root else tmp_path
    try:
        base.chmod(0o755)
        a, b = _small_trees(base)
        shutil.copytree(ROOT / "ep_image", base / "ep_image", ignore=PYCACHE)
        kw: dict = {"capture_output": True, "text": True, "timeout": 120}
        if as_root:
            kw |= {"user": NOBODY, "group": NOBODY}
        else:
            a.chmod(0o555)
        state = inodes(a), inodes(b), modes(a), modes(b)
        cmd = [python, "-m", "ep_image.build_steps.dedup", "--read-only", a, b]
        proc = subprocess.run(cmd, cwd=base, **kw)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert TRACEBACK not in proc.stderr and "Nothing was changed" in proc.stderr
        assert last_line(proc.stderr).startswith("dedup: fix: run dedup as the owner")
        assert (inodes(a), inodes(b), modes(a), modes(b)) == state
    finally:
        if (base / "a").exists():
            os.chmod(base / "a", 0o755)
        if as_root:
            shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("root", ["/", "/usr", "/usr/../etc"])
def test_a_system_tree_is_refused_at_once(root: str) -> None:
    """`dedup --dry-run /` walked the whole file system before; now it is refused at once."""
    started = time.monotonic()
    proc = run_dedup("--dry-run", root)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "a system tree, not a tree of venvs" in proc.stderr
    assert last_line(proc.stderr).startswith("dedup: fix: give the venvs' directories")
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("root", ["/mnt", "/media", "/var/tmp"])
def test_mount_points_are_system_trees_but_what_lies_below_them_is_not(root: str) -> None:
    """/mnt holds every disk mounted there: refused. /mnt/data/venvs is a ROOT like any other."""
    from ep_image.build_steps import dedup

    assert root in dedup.SYSTEM_TREES
    assert f"{root}/data/venvs" not in dedup.SYSTEM_TREES


def hold_dedup_lock(*roots: Path) -> contextlib.AbstractContextManager[None]:
    """The locks a dedup run on ``roots`` holds while it links (dedup.lock_roots)."""
    from ep_image.build_steps import dedup

    return dedup.lock_roots(dedup.resolve_roots(roots)[0])


def test_runs_on_nested_or_overlapping_trees_are_refused_and_siblings_run(tmp_path: Path) -> None:
    """With p/a being deduplicated, `dedup --dry-run p` walked p/a as it was relinked (rc 0).
    A run on a tree around, inside or overlapping one being linked is refused with the same
    one line as a run on the same trees; a run on a sibling tree is not held up."""
    p = tmp_path / "p"
    for tree in ("a/x", "b", "c"):
        (p / tree).mkdir(parents=True)
        (p / tree / "f.bin").write_bytes(b"same bytes\n" * 100)
    with hold_dedup_lock(p / "a"):
        for roots in ([p], [p / "a" / "x"], [p / "a"], [p / "c", p / "a" / "x"], [tmp_path]):
            proc = run_dedup("--dry-run", *roots)
            assert proc.returncode == 2, (roots, proc.stdout + proc.stderr)
            assert "another dedup run is working on" in proc.stderr, proc.stderr
            assert last_line(proc.stderr).startswith("dedup: fix: wait for it to end")
        sibling = run_dedup("--dry-run", p / "b", p / "c")
        assert sibling.returncode == 0, sibling.stdout + sibling.stderr
    with hold_dedup_lock(p):  # the other way round: the run below meets the one around it
        proc = run_dedup("--dry-run", p / "a")
        assert proc.returncode == 2 and f"working on {p}." in proc.stderr, proc.stderr
    assert run_dedup("--dry-run", p).returncode == 0  # released with the run


def test_a_second_run_on_the_same_trees_is_refused_while_the_first_links(
    venvs, tmp_path: Path
) -> None:
    """Two runs at once: the second would walk the trees while the first links them and book
    bytes it did not free. It is refused, naming the run that holds them; the first finishes
    with a report that adds up (du before and after, freed)."""
    a, b = venvs
    started, release = tmp_path / "linking", tmp_path / "go-on"
    env = wrapped_hardlink(
        tmp_path / "wrap",
        before=f"touch {started}; while [ ! -e {release} ]; do sleep 0.05; done",
    )
    report = tmp_path / "first.json"
    first = subprocess.Popen(
        [sys.executable, "-m", "ep_image.build_steps.dedup", "--json", str(report), str(a), str(b)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for(started, first)
        second = run_dedup(b, a)
        assert second.returncode == 2, second.stdout + second.stderr
        assert "another dedup run is working on" in second.stderr
    finally:
        release.touch()
        out, err = first.communicate(timeout=300)
    assert first.returncode == 0, out + err
    data = json.loads(report.read_text())
    assert data["du_bytes_before"] - data["du_bytes_after"] == data["saved_bytes"]
