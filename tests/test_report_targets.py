"""Where a command writes its report or record: never over a device, a FIFO or a link, and never
a directory made on a guess.

Why: a report is written to a temporary file that is renamed over the target, so whatever the
target was is replaced by a regular file. Run as root (as in the image), ``--json /dev/null``
would turn /dev/null into a file for every process on the machine. Each command here is run as
a user runs it, against a real device node (``mknod`` in a temporary directory), a FIFO and a
symbolic link, and must refuse before any work, leaving the node as it was. A path whose top
directory does not exist (``/nonexistent/dir/x.json``: in a container, a volume that was not
mounted) is refused too, and a refused run leaves no directory behind.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import clean_env

from ep_image import child_env
from ep_image.files.records import write_json

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mknod of a device node needs root")

#: Each command that takes --json, with arguments that would make it do its work.
PROBES = {
    "check_ep": ["-m", "ep_image.probes.check_ep", "--backend", "torch"],
    "check_te": ["-m", "ep_image.probes.check_te"],
    "check_env": ["-m", "ep_image.probes.check_env"],
    "check_fabric": ["-m", "ep_image.probes.check_fabric"],
}


def run(args: list[str | Path], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env=child_env(clean_env()),
        cwd=cwd,
    )


def device_node(path: Path) -> Path:
    """A character device like /dev/null (1, 3), made here."""
    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    return path


def still_a_device(path: Path) -> bool:
    st = os.lstat(path)
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)


def assert_refused_in_one_line(proc: subprocess.CompletedProcess[str], prog: str, what: str):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: usage error: "), proc.stderr
    assert what in lines[0] and "Traceback" not in proc.stderr, lines[0]


@needs_root
@pytest.mark.parametrize("probe", sorted(PROBES))
def test_a_probe_refuses_to_write_its_report_over_a_device_node(tmp_path: Path, probe: str):
    node = device_node(tmp_path / "null")
    proc = run([*PROBES[probe], "--json", node], tmp_path)
    assert_refused_in_one_line(proc, probe, "a character device")
    assert still_a_device(node), f"{probe} replaced the device node"


@needs_root
def test_upstream_test_refuses_a_device_node(tmp_path: Path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_intranode.py").write_text("raise SystemExit('must not run')\n")
    node = device_node(tmp_path / "null")
    proc = run(
        ["-m", "ep_image.probes.upstream_test", "--backend", "deepep_v1", "--tests", tests,
         "--json", node],
        tmp_path,
    )  # fmt: skip
    assert_refused_in_one_line(proc, "upstream_test", "a character device")
    assert still_a_device(node)


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_a_fifo_or_a_symbolic_link_is_refused_too(tmp_path: Path, kind: str):
    """A FIFO would be replaced by a file; a link (``/dev/stdout`` is one) would be replaced
    itself, not written through."""
    target = tmp_path / "report.json"
    if kind == "fifo":
        os.mkfifo(target)
    else:
        (tmp_path / "real.json").write_text("{}\n")
        target.symlink_to(tmp_path / "real.json")
    proc = run([*PROBES["check_env"], "--json", target], tmp_path)
    said = "a FIFO" if kind == "fifo" else "a symbolic link"
    assert_refused_in_one_line(proc, "check_env", said)
    assert target.is_fifo() if kind == "fifo" else target.is_symlink()


@needs_root
def test_dedup_refuses_a_device_node_before_changing_anything(tmp_path: Path):
    a, b = tmp_path / "a", tmp_path / "b"
    for root in (a, b):
        root.mkdir()
        (root / "same.bin").write_bytes(b"x" * 4096)
    node = device_node(tmp_path / "null")
    proc = run(["-m", "ep_image.build_steps.dedup", "--json", node, a, b], tmp_path)
    assert_refused_in_one_line(proc, "dedup", "a character device")
    assert still_a_device(node)
    assert (a / "same.bin").stat().st_ino != (b / "same.bin").stat().st_ino, "it linked"


@needs_root
def test_build_te_refuses_a_device_node_where_its_record_goes(tmp_path: Path):
    out = tmp_path / "out"
    out.mkdir()
    node = device_node(out / "te-build.json")
    proc = run(["-m", "ep_image.build_steps.build_te", "--mode", "skip", "--out", out], tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "a character device" in proc.stderr and "te-build.json" in proc.stderr
    assert still_a_device(node)


@needs_root
@pytest.mark.parametrize("mode", ["--complete", "--skeleton"])
def test_make_venv_refuses_a_device_node_where_a_record_goes(tmp_path: Path, mode: str):
    """--complete writes <prefix>/<backend>/ep-backend.json, --skeleton
    <prefix>/venvs-common.json: both are refused before any build step."""
    prefix = tmp_path / "venvs"
    where = prefix / "deepep_v2" if mode == "--complete" else prefix
    where.mkdir(parents=True)
    record = "ep-backend.json" if mode == "--complete" else "venvs-common.json"
    node = device_node(where / record)
    proc = run(
        ["-m", "ep_image.build_steps.make_venv", mode, "--backend", "deepep_v2", "--prefix",
         prefix],
        tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "a character device" in proc.stderr and record in proc.stderr, proc.stderr
    assert "uv lock" not in proc.stdout + proc.stderr, "it did work before refusing"
    assert still_a_device(node)


@needs_root
def test_the_one_writer_of_records_refuses_to_replace_a_device(tmp_path: Path):
    """records.write_json, which every record goes through, checks again at write time."""
    node = device_node(tmp_path / "record.json")
    with pytest.raises(OSError, match="a character device"):
        write_json(node, {"a": 1})
    assert still_a_device(node)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json"], "a temporary was left"


# ---- directories that do not exist -------------------------------------------------------------


@pytest.mark.parametrize("command", ["check_ep", "dedup"])
def test_a_report_under_a_top_directory_that_does_not_exist_is_refused(
    tmp_path: Path, command: str
):
    top = Path("/") / f"ep-image-test-{uuid.uuid4().hex[:12]}"
    target = top / "dir" / "x.json"
    if command == "check_ep":
        args = [*PROBES["check_ep"], "--json", target]
    else:
        (tmp_path / "a").mkdir()
        args = ["-m", "ep_image.build_steps.dedup", "--json", target, tmp_path / "a"]
    try:
        proc = run(args, tmp_path)
        assert_refused_in_one_line(proc, command, str(top))
        assert not top.exists(), f"{command} made {top}"
    finally:
        if top.exists():
            for dirpath, _dirs, files in os.walk(top, topdown=False):
                for name in files:
                    os.unlink(os.path.join(dirpath, name))
                os.rmdir(dirpath)


def test_a_refused_run_makes_no_directory_and_a_finished_one_makes_its_own(tmp_path: Path):
    new = tmp_path / "reports" / "deeper"
    refused = run([*PROBES["check_ep"], "--topk", "0", "--json", new / "x.json"], tmp_path)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert not (tmp_path / "reports").exists(), "a refused run left a directory"
    done = run([*PROBES["check_env"], "--json", new / "env.json"], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads((new / "env.json").read_text())["probe"] == "check_env"


@needs_root
def test_image_stage_refuses_a_device_node_where_its_records_go(tmp_path: Path):
    prefix = tmp_path / "venvs"
    prefix.mkdir()
    node = device_node(prefix / "te-build.json")
    proc = run(
        ["-m", "ep_image.build_steps.image_stage", "--prefix", prefix, "assemble", "--in-place",
         "deepep_v2"],
        tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "a character device" in proc.stderr and "te-build.json" in proc.stderr, proc.stderr
    assert still_a_device(node)
