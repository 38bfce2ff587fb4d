"""ep_image/build_steps/dedup/ (util-linux hardlink plus our rules) on real venvs made by uv.

The venvs are made with UV_LINK_MODE=copy: every file a separate copy. Each test states one rule
of docs/host-mode.md ("Deduplicating venvs") and checks it against an independent measurement:
sha256 and mode of every file before and after, the inode of every path, apparent bytes counted
here, `du` itself. The installer tests reinstall, upgrade, uninstall and clobber packages in one
deduplicated venv with uv and pip and prove the other venv did not change. The fault tests act
at an exact system call of the real run (tests/_fault_inject.py): a file deleted mid-run, a kill
between the temporary link and the rename.
"""

from __future__ import annotations

import json
import os
import py_compile
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _fault_inject import faulty_env
from _venv_helpers import (
    apparent_bytes,
    build_wheel,
    copy_env,
    dedup_json,
    du_total,
    inodes,
    install,
    make_uv_venv,
    run_dedup,
    site_packages,
    snapshot,
    uv,
)

from ep_image.build_steps import dedup
from ep_image.build_steps.dedup.tree import TEMP_SUFFIX

PACKAGES = ("six==1.17.0", "packaging==26.4", "attrs==26.1.0")
NOBODY = 65534


def both(a: Path, b: Path) -> dict[str, tuple[str, int]]:
    return {
        **{f"a/{k}": v for k, v in snapshot(a).items()},
        **{f"b/{k}": v for k, v in snapshot(b).items()},
    }


def both_inodes(a: Path, b: Path) -> dict[str, tuple[int, int]]:
    return {
        **{f"a/{k}": v for k, v in inodes(a).items()},
        **{f"b/{k}": v for k, v in inodes(b).items()},
    }


@pytest.fixture
def venvs(tmp_path: Path) -> tuple[Path, Path]:
    """Two real venvs holding the same three small packages, as separate copies."""
    a = make_uv_venv(tmp_path / "a", *PACKAGES)
    b = make_uv_venv(tmp_path / "b", *PACKAGES)
    return a, b


@pytest.fixture
def world_tmp() -> Iterator[Path]:
    """A 0755 directory under /tmp, so a non-root user can reach the trees in it."""
    path = Path(tempfile.mkdtemp(prefix="dedup-test-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_links_identical_files_keeping_every_byte_and_mode(venvs, tmp_path: Path) -> None:
    a, b = venvs
    before = both(a, b)
    inodes_before = both_inodes(a, b)
    assert len(set(inodes_before.values())) == len(inodes_before), "copies start unlinked"
    bytes_before = apparent_bytes(a, b)
    du_before = du_total(a, b)

    report = dedup_json(tmp_path, a, b)

    assert both(a, b) == before, "every file keeps its bytes and mode"
    after = both_inodes(a, b)
    shared: dict[tuple[int, int], list[str]] = {}
    for path, ino in after.items():
        shared.setdefault(ino, []).append(path)
    for paths in shared.values():
        assert len({before[p] for p in paths}) == 1, f"linked files differed: {paths}"
    rel = site_packages(a).relative_to(a) / "packaging" / "version.py"
    assert after[f"a/{rel}"] == after[f"b/{rel}"], "identical files share an inode"
    assert report["files_linked"] > 50
    assert report["bytes_before"] == bytes_before
    assert report["bytes_after"] == apparent_bytes(a, b) < bytes_before
    assert (report["du_bytes_before"], report["du_bytes_after"]) == (du_before, du_total(a, b))
    assert report["saved_bytes"] == du_before - report["du_bytes_after"] > 0
    assert after["a/pyvenv.cfg"] != after["b/pyvenv.cfg"], "pyvenv.cfg is excluded"


def test_second_run_is_a_no_op(venvs, tmp_path: Path) -> None:
    a, b = venvs
    first = dedup_json(tmp_path, a, b)
    state = both_inodes(a, b), both(a, b)
    second = dedup_json(tmp_path, a, b)
    assert second["files_linked"] == 0 and second["inodes_merged"] == 0
    assert second["bytes_before"] == second["bytes_after"] == first["bytes_after"]
    assert (both_inodes(a, b), both(a, b)) == state


def test_dry_run_predicts_and_changes_nothing(venvs, tmp_path: Path) -> None:
    a, b = venvs
    state = both_inodes(a, b), both(a, b)
    dry = dedup_json(tmp_path, a, b, extra=("--dry-run",))
    assert (both_inodes(a, b), both(a, b)) == state
    real = dedup_json(tmp_path, a, b)
    assert (dry["files_linked"], dry["bytes_after"]) == (real["files_linked"], real["bytes_after"])


def test_different_content_is_never_linked(venvs, tmp_path: Path) -> None:
    a, b = venvs
    # Same size, different bytes: one differs only in its last byte, one only in its first.
    (a / "blob.bin").write_bytes(b"x" * 65536 + b"1")
    (b / "blob.bin").write_bytes(b"x" * 65536 + b"2")
    (a / "head.bin").write_bytes(b"A" + b"y" * 4096)
    (b / "head.bin").write_bytes(b"B" + b"y" * 4096)
    # 3 MiB, equal but for the very last byte: past any first block or read buffer.
    (a / "tail.bin").write_bytes(b"z" * ((3 << 20) - 1) + b"y")
    (b / "tail.bin").write_bytes(b"z" * (3 << 20))
    (a / "same.bin").write_bytes(b"z" * (3 << 20))
    (b / "same.bin").write_bytes(b"z" * (3 << 20))
    dedup_json(tmp_path, a, b)
    for name in ("blob.bin", "head.bin", "tail.bin"):
        assert (a / name).stat().st_ino != (b / name).stat().st_ino, name
    assert (a / "same.bin").stat().st_ino == (b / "same.bin").stat().st_ino
    assert (a / "blob.bin").read_bytes()[-1:] == b"1"
    assert (b / "head.bin").read_bytes()[:1] == b"B"
    assert (a / "tail.bin").read_bytes()[-1:] == b"y"


def test_files_whose_mode_or_owner_differ_are_not_linked(venvs, tmp_path: Path) -> None:
    a, b = venvs
    sp_a, sp_b = site_packages(a), site_packages(b)
    (sp_b / "six.py").chmod(0o600)
    os.chown(sp_b / "packaging" / "version.py", 12345, -1)
    os.chown(sp_b / "packaging" / "tags.py", -1, 12345)
    os.setxattr(sp_b / "packaging" / "markers.py", "user.ep-test", b"1")
    before = both(a, b)

    dedup_json(tmp_path, a, b)

    assert both(a, b) == before, "modes unchanged"
    for rel in ("six.py", "packaging/version.py", "packaging/tags.py", "packaging/markers.py"):
        assert (sp_a / rel).stat().st_ino != (sp_b / rel).stat().st_ino, rel
    assert (sp_b / "packaging" / "version.py").stat().st_uid == 12345
    assert (sp_b / "packaging" / "tags.py").stat().st_gid == 12345
    assert os.getxattr(sp_b / "packaging" / "markers.py", "user.ep-test") == b"1"
    assert not os.listxattr(sp_a / "packaging" / "markers.py")
    assert (sp_a / "packaging/utils.py").stat().st_ino == (
        sp_b / "packaging/utils.py"
    ).stat().st_ino


def test_roots_on_different_filesystems_are_refused(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on a filesystem other than the test's tmp dir")
    on_shm = Path(tempfile.mkdtemp(dir=shm))
    try:
        for root in (tmp_path / "t", on_shm):
            root.mkdir(exist_ok=True)
            (root / "same.txt").write_text("identical\n" * 100)
        state = snapshot(tmp_path), snapshot(on_shm), inodes(tmp_path), inodes(on_shm)
        proc = run_dedup(tmp_path / "t", on_shm)
        assert proc.returncode == 2
        assert "different filesystems" in proc.stderr and "Nothing was changed" in proc.stderr
        assert "Traceback" not in proc.stderr
        assert (snapshot(tmp_path), snapshot(on_shm), inodes(tmp_path), inodes(on_shm)) == state
    finally:
        shutil.rmtree(on_shm)


def test_symlinks_and_special_files_are_left_alone(venvs, tmp_path: Path) -> None:
    a, b = venvs
    for root in (a, b):
        (root / "data.txt").write_text("payload\n" * 64)
        os.symlink("data.txt", root / "link.txt")
        os.mkfifo(root / "pipe")
    dedup_json(tmp_path, a, b)
    for root in (a, b):
        assert (root / "link.txt").is_symlink() and os.readlink(root / "link.txt") == "data.txt"
        assert (root / "pipe").is_fifo()
    assert (a / "data.txt").stat().st_ino == (b / "data.txt").stat().st_ino


def test_crash_mid_run_leaves_every_path_a_complete_file(venvs, tmp_path: Path, shim) -> None:
    """SIGKILL between hardlink's temporary link and its rename: the worst moment to die."""
    a, b = venvs
    before = both(a, b)
    env = faulty_env(shim, EP_FAULT_KILL_AT_RENAME="10")
    proc = run_dedup(a, b, env=env)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert "killed by SIGKILL" in proc.stderr, "the report says what happened"

    # The one temporary link hardlink left is dedup's by its record of the run: removed by
    # the same run (tests/test_dedup_own_files.py: and by the next one when dedup was killed
    # too).
    assert "removed 1 temporary links a killed hardlink left" in proc.stdout, proc.stdout
    assert both(a, b) == before, "every path holds its file, and nothing else is left"
    ids = both_inodes(a, b)
    assert len(set(ids.values())) < len(ids), "the first 10 links were made before the crash"

    report = dedup_json(tmp_path, a, b)
    assert report["stale_temps_removed"] == 0
    assert not [p for r in (a, b) for p in r.rglob(f"*{TEMP_SUFFIX}")]
    assert both(a, b) == before


def test_a_file_deleted_mid_run_is_reported_not_a_traceback(tmp_path: Path, shim) -> None:
    """Another process deletes a duplicate after the walk saw it, before it is compared.

    Three equal files; a's has a second link, so hardlink keeps it (--maximize) and compares
    the others newest first: b/trigger.bin, then the older victim. Opening the kept file to
    compare it with b/trigger.bin deletes the victim (the old dedup.py opened a/trigger.bin
    first too, to hash it), so the victim has vanished when its turn comes.
    """
    a, b = tmp_path / "a", tmp_path / "b"
    for directory in (a / "extra", b / "zz"):
        directory.mkdir(parents=True)
    payload = b"t" * (8 << 20)
    (a / "trigger.bin").write_bytes(payload)
    os.link(a / "trigger.bin", a / "extra" / "trigger.bin")
    (b / "trigger.bin").write_bytes(payload)
    victim = b / "zz" / "victim.bin"
    victim.write_bytes(payload)
    os.utime(victim, (time.time() - 3600, time.time() - 3600))
    report_path = tmp_path / "report.json"
    env = faulty_env(shim, EP_FAULT_UNLINK_ON_OPEN=f"/trigger.bin:{victim}")

    proc = run_dedup("--json", report_path, a, b, env=env)

    assert "Traceback" not in proc.stderr, proc.stderr
    assert not victim.exists(), "the fault happened"
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads(report_path.read_text())
    assert any(str(victim) in failure for failure in report["failures"]), report["failures"]
    assert any("run dedup again" in failure for failure in report["failures"])
    assert (a / "trigger.bin").stat().st_ino == (b / "trigger.bin").stat().st_ino
    assert (a / "trigger.bin").read_bytes() == payload
    assert report["du_bytes_after"] == du_total(a, b)
    again = run_dedup(a, b)
    assert again.returncode == 0, again.stdout + again.stderr


def test_saved_bytes_are_what_du_sees_freed_with_links_from_outside(tmp_path: Path) -> None:
    """Inodes also linked from outside the ROOTs (uv's cache): merging them frees nothing."""
    a, b, cache_a, cache_b = (tmp_path / n for n in ("a", "b", "cache_a", "cache_b"))
    for d in (a, b, cache_a, cache_b):
        d.mkdir()
    # Both copies also live in a cache: linking them shares an inode here but frees nothing.
    both_cached = os.urandom(1 << 20)
    for cache, root in ((cache_a, a), (cache_b, b)):
        (cache / "both.so").write_bytes(both_cached)
        os.link(cache / "both.so", root / "both.so")
    # Only b's copy is in a cache: the space comes back only if a's copy is the one replaced.
    one_cached = os.urandom(1 << 20)
    (a / "one.so").write_bytes(one_cached)
    (cache_b / "one.so").write_bytes(one_cached)
    os.link(cache_b / "one.so", b / "one.so")
    everything = (a, b, cache_a, cache_b)
    du_before, du_roots_before = du_total(*everything), du_total(a, b)

    report = dedup_json(tmp_path, a, b)

    freed = du_before - du_total(*everything)
    claimed = report.get("saved_bytes", report["bytes_before"] - report["bytes_after"])
    assert claimed == freed, f"report claims {claimed} B saved, du shows {freed} B freed"
    assert freed == (cache_b / "one.so").stat().st_blocks * 512, "a's copy of one.so was freed"
    assert (a / "one.so").stat().st_ino == (cache_b / "one.so").stat().st_ino
    assert (a / "both.so").stat().st_ino == (b / "both.so").stat().st_ino
    assert report["shared_not_freed_bytes"] == (a / "both.so").stat().st_blocks * 512
    assert (report["du_bytes_before"], report["du_bytes_after"]) == (
        du_roots_before,
        du_total(a, b),
    )


def test_bytecode_keeps_validating_after_dedup(tmp_path: Path) -> None:
    """Timestamp .pyc files stay valid: a .py is linked only to one with the same mtime."""
    a = make_uv_venv(tmp_path / "a", "--compile-bytecode", *PACKAGES)
    time.sleep(1.1)  # the second venv's sources get a later mtime (seconds)
    b = make_uv_venv(tmp_path / "b", "--compile-bytecode", *PACKAGES)

    def valid_pycs(venv: Path) -> set[str]:
        valid = set()
        for pyc in site_packages(venv).rglob("__pycache__/*.pyc"):
            source = pyc.parent.parent / (pyc.name.split(".")[0] + ".py")
            header = pyc.read_bytes()[:16]
            flags = int.from_bytes(header[4:8], "little")
            mtime = int.from_bytes(header[8:12], "little")
            if source.exists() and flags == 0 and mtime == int(source.stat().st_mtime):
                valid.add(str(pyc.relative_to(venv)))
        return valid

    valid_before = valid_pycs(a), valid_pycs(b)
    assert valid_before[0] and valid_before[1]
    report = dedup_json(tmp_path, a, b)
    assert (valid_pycs(a), valid_pycs(b)) == valid_before
    assert report["timestamp_pyc"], "the report says the bytecode rule was applied"
    rel = "packaging/version.py"
    assert (site_packages(a) / rel).stat().st_ino != (site_packages(b) / rel).stat().st_ino


def _pyc_matches_source(pyc: Path, source: Path) -> bool:
    """importlib's test of a timestamp .pyc: its recorded source mtime and size are current."""
    header = pyc.read_bytes()[:16]
    st = source.stat()
    return (
        int.from_bytes(header[4:8], "little") == 0
        and int.from_bytes(header[8:12], "little") == int(st.st_mtime) & 0xFFFFFFFF
        and int.from_bytes(header[12:16], "little") == st.st_size & 0xFFFFFFFF
    )


def test_bytecode_rule_holds_for_every_path_of_an_already_linked_inode(tmp_path: Path) -> None:
    """a/m.py and b/m.py share an inode (an earlier run); only b's __pycache__ pins its mtime."""
    roots = [tmp_path / name for name in "abcde"]
    for root in roots:
        root.mkdir()
    a, b, c, d, e = roots
    source = "VALUE = 1\n" * 200
    (a / "m.py").write_text(source)
    os.link(a / "m.py", b / "m.py")
    pyc = Path(
        py_compile.compile(
            str(b / "m.py"),
            cfile=str(b / "__pycache__" / "m.cpython-311.pyc"),
            invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP,
            doraise=True,
        )
    )
    (c / "m.py").write_text(source)  # same bytes, another mtime, linked from three places
    later = (a / "m.py").stat().st_mtime + 100
    os.utime(c / "m.py", (later, later))
    os.link(c / "m.py", d / "m.py")
    os.link(c / "m.py", e / "m.py")
    assert _pyc_matches_source(pyc, b / "m.py")

    dedup_json(tmp_path, *roots)

    assert _pyc_matches_source(pyc, b / "m.py"), "b's bytecode went stale"
    assert (a / "m.py").stat().st_ino == (b / "m.py").stat().st_ino


def test_hash_checked_bytecode_lets_sources_link(tmp_path: Path) -> None:
    """With SOURCE_DATE_EPOCH set, pycs are hash-checked and the .py files may share inodes."""
    a = make_uv_venv(tmp_path / "a", "--compile-bytecode", *PACKAGES, SOURCE_DATE_EPOCH="0")
    time.sleep(1.1)
    b = make_uv_venv(tmp_path / "b", "--compile-bytecode", *PACKAGES, SOURCE_DATE_EPOCH="0")
    dedup_json(tmp_path, a, b)
    rel = "packaging/version.py"
    assert (site_packages(a) / rel).stat().st_ino == (site_packages(b) / rel).stat().st_ino


@pytest.mark.parametrize("link_mode", ["copy", "hardlink", "clone"])
def test_uv_never_writes_through_a_shared_inode(venvs, tmp_path: Path, link_mode: str) -> None:
    """The hazard of hardlinked venvs, exercised: installs in `a` must not change `b`."""
    a, b = venvs
    wheels = tmp_path / "wheels"
    one = build_wheel(wheels, "clobone", "1.0", {"clob/data.txt": "one\n" * 512})
    two = build_wheel(wheels, "clobtwo", "1.0", {"clob/data.txt": "two\n" * 512})
    for venv in (a, b):
        install(venv, str(one))
    dedup_json(tmp_path, a, b)
    rel_clob = site_packages(a).relative_to(a) / "clob" / "data.txt"
    assert (a / rel_clob).stat().st_ino == (b / rel_clob).stat().st_ino
    b_before = snapshot(b)
    env = {"UV_LINK_MODE": link_mode}

    install(a, "--reinstall", *PACKAGES, **env)  # same files rewritten
    install(a, "packaging==24.2", **env)  # different content at the same paths
    install(a, str(two), **env)  # a second package overwriting clob/data.txt
    uv("pip", "uninstall", "-q", "--python", str(a / "bin" / "python"), "six")

    assert snapshot(b) == b_before, "b is unchanged"
    assert (a / rel_clob).read_text().startswith("two")
    assert (a / rel_clob).stat().st_ino != (b / rel_clob).stat().st_ino


def test_pip_never_writes_through_a_shared_inode(tmp_path: Path) -> None:
    a = make_uv_venv(tmp_path / "a", seed=True)
    b = make_uv_venv(tmp_path / "b", seed=True)
    wheels = tmp_path / "wheels"
    one = build_wheel(wheels, "clobone", "1.0", {"clob/data.txt": "one\n" * 512})
    one_b = build_wheel(wheels, "clobone", "2.0", {"clob/data.txt": "ONE\n" * 512})
    two = build_wheel(wheels, "clobtwo", "1.0", {"clob/data.txt": "two\n" * 512})
    for venv in (a, b):
        install(venv, str(one))
    dedup_json(tmp_path, a, b)
    b_before = snapshot(b)
    pip = [str(a / "bin" / "python"), "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
    for args in (["--force-reinstall", str(one)], [str(one_b)], [str(two)]):
        proc = subprocess.run([*pip, *args], capture_output=True, text=True, env=copy_env())
        assert proc.returncode == 0, proc.stderr
    assert snapshot(b) == b_before
    rel = site_packages(a) / "clob" / "data.txt"
    assert rel.read_text().startswith("two")


def _uv_for(directory: Path) -> str:
    """uv's binary reachable by a non-root user (/root is 0700 here): a link in ``directory``."""
    found = os.environ.get("UV") or shutil.which("uv")
    real = Path(found).resolve() if found else None
    if real is None or real.read_bytes()[:4] != b"\x7fELF":
        pytest.skip("needs uv's binary (run under `uv run`, which sets UV)")
    target = directory / "uv"
    try:
        os.link(real, target)
    except OSError:
        shutil.copy2(real, target)
    return str(target)


def test_read_only_blocks_in_place_writes_and_installers_still_work(world_tmp: Path) -> None:
    """Host mode: the user owns the prefix; --read-only turns a cross-venv write into EACCES."""
    system_python = shutil.which("python3", path="/usr/bin:/bin")
    if os.geteuid() != 0 or not system_python:
        pytest.skip("needs root (to act as another user) and a system python3")
    uv_bin = _uv_for(world_tmp)
    wheels = world_tmp / "wheels"
    pkg = build_wheel(wheels, "ropkg", "1.0", {"ropkg/__init__.py": "VALUE = 1\n" * 200})
    a = make_uv_venv(world_tmp / "a", str(pkg), python=system_python)
    b = make_uv_venv(world_tmp / "b", str(pkg), python=system_python)
    subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(world_tmp)], check=True)
    target_a = site_packages(a) / "ropkg" / "__init__.py"
    target_b = site_packages(b) / "ropkg" / "__init__.py"
    original = target_a.read_bytes()
    cfg_mode = (a / "pyvenv.cfg").stat().st_mode
    as_nobody = {"user": NOBODY, "group": NOBODY, "capture_output": True, "text": True}
    write = [system_python, "-c", f"open({str(target_a)!r}, 'r+b').write(b'#')"]

    # The hazard, shown: without --read-only, an in-place write into `a` changes `b` too.
    dedup_json(world_tmp, a, b)
    assert subprocess.run(write, **as_nobody).returncode == 0
    assert target_b.read_bytes().startswith(b"#")
    target_a.write_bytes(original)  # one inode: restores both

    # With --read-only the shared inode loses its write bits: the same write now fails.
    report = dedup_json(world_tmp, a, b, extra=("--read-only",))
    assert report["files_made_read_only"] >= 2
    assert target_a.stat().st_mode & 0o222 == 0 and target_b.stat().st_mode & 0o222 == 0
    assert (a / "pyvenv.cfg").stat().st_mode == cfg_mode, "unshared files keep their mode"
    proc = subprocess.run(write, **as_nobody)
    assert proc.returncode != 0 and "PermissionError" in proc.stderr
    assert target_b.read_bytes() == original

    # Installers unlink and recreate, so they still work on read-only files (as the owner).
    b_before = snapshot(b)
    reinstall = [
        uv_bin, "pip", "install", "-q", "--no-index", "--reinstall",
        "--python", str(a / "bin" / "python"), str(pkg),
    ]  # fmt: skip
    env = copy_env(UV_CACHE_DIR=str(world_tmp / "uv-cache"), HOME=str(world_tmp))
    proc = subprocess.run(reinstall, env=env, **as_nobody)
    assert proc.returncode == 0, proc.stderr
    uninstall = [uv_bin, "pip", "uninstall", "-q", "--python", str(b / "bin" / "python"), "ropkg"]
    snapshot_a = snapshot(a)
    proc = subprocess.run(uninstall, env=env, **as_nobody)
    assert proc.returncode == 0, proc.stderr
    assert not target_b.exists() and snapshot(a) == snapshot_a
    assert b_before[str(target_b.relative_to(b))][0] == snapshot_a[str(target_a.relative_to(a))][0]


def test_read_only_leaves_inodes_linked_from_outside_alone(tmp_path: Path) -> None:
    """Files sharing an inode with uv's cache (anything outside the ROOTs) keep their mode.

    Under --read-only a copy is not linked into such an inode either: it could not be made
    read-only, so the link would add a writable path shared across venvs.
    """
    a, b, cache = (tmp_path / n for n in ("a", "b", "cache"))
    for d in (a, b, cache):
        d.mkdir()
    (cache / "lib.so").write_bytes(b"\x7fELF" + b"0" * 8192)
    os.link(cache / "lib.so", a / "lib.so")
    (b / "lib.so").write_bytes((cache / "lib.so").read_bytes())
    (a / "own.py").write_text("x = 1\n" * 100)
    (b / "own.py").write_text("x = 1\n" * 100)
    (a / "alone.txt").write_text("only in a\n")
    mode_b, mode_alone = (b / "lib.so").stat().st_mode, (a / "alone.txt").stat().st_mode
    report = dedup_json(tmp_path, a, b, extra=("--read-only",))
    assert (cache / "lib.so").stat().st_mode & 0o222, "the cache's file keeps its write bits"
    assert (a / "lib.so").stat().st_ino == (cache / "lib.so").stat().st_ino
    assert (a / "lib.so").stat().st_ino != (b / "lib.so").stat().st_ino
    assert (b / "lib.so").stat().st_mode == mode_b, "b's copy, unshared, keeps its mode"
    assert (a / "alone.txt").stat().st_mode == mode_alone, "unshared files keep their mode"
    assert (a / "own.py").stat().st_ino == (b / "own.py").stat().st_ino
    assert (a / "own.py").stat().st_mode & 0o222 == 0
    assert report["files_made_read_only"] == 2

    # Without --read-only the copy joins the cache's inode (kept: it has the most links).
    report = dedup_json(tmp_path, a, b)
    assert (b / "lib.so").stat().st_ino == (cache / "lib.so").stat().st_ino
    assert report["saved_bytes"] > 0


def test_read_only_still_links_a_venv_added_later(venvs, tmp_path: Path) -> None:
    """Write bits keep no copies apart under --read-only: a new venv links to read-only inodes."""
    a, b = venvs
    dedup_json(tmp_path, a, b, extra=("--read-only",))
    rel = site_packages(a).relative_to(a) / "packaging" / "version.py"
    assert (a / rel).stat().st_mode & 0o222 == 0
    c = make_uv_venv(tmp_path / "c", *PACKAGES)
    assert (c / rel).stat().st_mode & 0o200, "a fresh copy is writable"
    report = dedup_json(tmp_path, a, b, c, extra=("--read-only",))
    assert (c / rel).stat().st_ino == (a / rel).stat().st_ino
    assert (c / rel).stat().st_mode & 0o222 == 0
    assert report["files_linked"] > 50
    assert (c / "pyvenv.cfg").stat().st_mode & 0o200, "excluded files keep their mode"


@pytest.mark.parametrize(
    ("relative", "excluded"),
    [
        ("pyvenv.cfg", True),
        ("deepep_v1/pyvenv.cfg", True),
        ("deepep_v1/bin/activate", True),
        ("deepep_v1/bin/activate.fish", True),
        ("bin/torchrun", False),
        ("lib/python3.12/site-packages/_virtualenv.pth", True),
        ("lib/python3.12/site-packages/torch-2.14.1.dist-info/RECORD", True),
        ("lib/python3.12/site-packages/torch-2.14.1.dist-info/METADATA", False),
        ("lib/python3.12/site-packages/torch/lib/libtorch_cuda.so", False),
    ],
)
def test_default_excludes(relative: str, excluded: bool) -> None:
    assert dedup.is_excluded(relative, dedup.DEFAULT_EXCLUDES) is excluded


def test_hardlink_honours_the_excludes(tmp_path: Path) -> None:
    """The same table, through the real tool: excluded paths keep separate inodes."""
    table = {
        "pyvenv.cfg": True,
        "bin/activate": True,
        "bin/activate.fish": True,
        "bin/torchrun": False,
        "lib/python3.12/site-packages/_virtualenv.pth": True,
        "lib/python3.12/site-packages/torch-2.14.1.dist-info/RECORD": True,
        "lib/python3.12/site-packages/torch-2.14.1.dist-info/METADATA": False,
        "lib/python3.12/site-packages/torch/lib/libtorch_cuda.so": False,
        "lib/python3.12/site-packages/weird [name]/x.so": False,
    }
    a, b = tmp_path / "a", tmp_path / "b"
    for root in (a, b):
        for rel in table:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(f"content of {rel}\n")
    dedup_json(tmp_path, a, b)
    for rel, excluded in table.items():
        shared = (a / rel).stat().st_ino == (b / rel).stat().st_ino
        assert shared is not excluded, rel


def test_bad_root_is_refused(tmp_path: Path) -> None:
    proc = run_dedup(tmp_path / "missing")
    assert proc.returncode == 2 and "not a directory" in proc.stderr
