"""dedup on overlayfs, the file system of container builds and their layers.

Why: an overlay's upper directory holds only what was written in this layer, while `du` of the
merged view counts every layer. Linking a file of a lower layer copies it up, so the layer grows
while `du` says it shrank; changing its mode (``--read-only``) copies it up too; and util-linux
hardlink's xattr comparison aborts on copied-up files (overlayfs reports more attribute names
when asked for their size than it lists). Real overlay mounts (tests/_mounts.py), the real
hardlink, the upper directory measured by `du` itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import _mounts as mounts
import pytest
from _venv_helpers import du_total, run_dedup

pytestmark = pytest.mark.skipif(
    mounts.why_not("overlay") is not None, reason=str(mounts.why_not("overlay"))
)

MiB = 1 << 20


def layered(base: Path) -> tuple[Path, Path]:
    """A lower layer with two trees holding the same four files, and two more equal files
    written in the upper layer (through the merged view): the lower directory."""
    lower = base / "lower"
    for name in ("a", "b"):
        (lower / name).mkdir(parents=True)
        for i in range(4):
            (lower / name / f"f{i}.bin").write_bytes(bytes([i + 1]) * (2 * MiB))
    return lower


def write_in_this_layer(merged: Path) -> None:
    for name in ("a", "b"):
        (merged / name / "new.bin").write_bytes(b"n" * (3 * MiB))


def upper_du(upper: Path) -> int:
    return du_total(*(upper / name for name in ("a", "b")))


def test_only_this_layers_files_are_linked_and_the_layer_is_measured(tmp_path: Path) -> None:
    lower = layered(tmp_path)
    with mounts.overlay(tmp_path / "ovl", lower) as (merged, upper):
        write_in_this_layer(merged)
        before = upper_du(upper)
        out = tmp_path / "report.json"
        proc = run_dedup("--json", out, merged / "a", merged / "b")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        after = upper_du(upper)
        report = json.loads(out.read_text())
        # Before: the lower files were linked, each copied up: the layer grew by 8 MiB while
        # the report said "freed 8 MiB".
        assert after < before, f"the layer grew from {before} to {after}"
        assert not (upper / "a" / "f0.bin").exists(), "a lower layer's file was copied up"
        assert report["saved_bytes"] == before - after, report
        assert (merged / "a" / "new.bin").stat().st_ino == (merged / "b" / "new.bin").stat().st_ino
        assert (merged / "a" / "f0.bin").stat().st_ino != (merged / "b" / "f0.bin").stat().st_ino
        assert report["overlay"]["upper"] == str(upper), report["overlay"]
        assert any("lower layer" in reason for reason in report["skipped"]), report["skipped"]
        assert "lower layer" in proc.stdout and "copies it up" in proc.stdout, proc.stdout
        # And again: a second run is a no-op, not hardlink's abort on copied-up files.
        again = run_dedup(merged / "a", merged / "b")
        assert again.returncode == 0, again.stdout + again.stderr
        assert upper_du(upper) == after


def test_read_only_copies_up_nothing_of_a_lower_layer(tmp_path: Path) -> None:
    lower = layered(tmp_path)
    with mounts.overlay(tmp_path / "ovl", lower) as (merged, upper):
        write_in_this_layer(merged)
        proc = run_dedup("--read-only", merged / "a", merged / "b")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        copied = sorted(p.name for p in (upper / "a").iterdir() if p.name.startswith("f"))
        assert copied == [], f"--read-only copied up {copied}"
        assert (merged / "a" / "new.bin").stat().st_mode & 0o222 == 0, "shared, not read-only"


def test_copied_up_files_do_not_stop_hardlink(tmp_path: Path) -> None:
    """Files copied up by an earlier step (here: a chmod through the merged view) carry
    overlayfs' own attributes: hardlink --respect-xattrs aborted on them ("file_xattrs_equal:
    Assertion ... failed") in every run, each saying to run dedup again."""
    lower = layered(tmp_path)
    with mounts.overlay(tmp_path / "ovl", lower) as (merged, upper):
        for name in ("a", "b"):
            for i in range(4):
                (merged / name / f"f{i}.bin").chmod(0o640)  # copies each up
        proc = run_dedup(merged / "a", merged / "b")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "Assertion" not in proc.stderr
        assert (merged / "a" / "f0.bin").stat().st_ino == (merged / "b" / "f0.bin").stat().st_ino
        assert (upper / "a" / "f0.bin").stat().st_ino == (upper / "b" / "f0.bin").stat().st_ino


def test_an_upper_layer_it_cannot_see_is_said_and_measured_by_free_space(tmp_path: Path) -> None:
    """Inside a container build the upper directory is a path of the host: which file lies in
    which layer cannot be told, so the report measures what the file system under the layer
    got back and says why `du` of the merged view is not that; --read-only, which would copy
    up every file of a lower layer it changes, is refused."""
    if subprocess.run(["unshare", "--help"], capture_output=True).returncode != 0:
        pytest.skip("needs unshare (util-linux)")
    lower = layered(tmp_path)
    with mounts.overlay(tmp_path / "ovl", lower) as (merged, upper):
        write_in_this_layer(merged)
        out = tmp_path / "report.json"
        hide = f'mount -t tmpfs none {upper.parent / "upper"} && exec "$@"'
        base = ["unshare", "--mount", "--propagation", "private", "sh", "-c", hide, "sh"]
        dedup = [sys.executable, "-m", "ep_image.build_steps.dedup"]
        args = [str(merged / "a"), str(merged / "b")]
        refused = subprocess.run(
            [*base, *dedup, "--read-only", *args], capture_output=True, text=True, timeout=300
        )
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert "overlay" in refused.stderr and "--read-only" in refused.stderr
        proc = subprocess.run(
            [*base, *dedup, "--json", str(out), *args], capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        report = json.loads(out.read_text())
        assert report["overlay"]["upper"] is None, report["overlay"]
        assert report["overlay"]["measured_by"] == "free space", report["overlay"]
        assert "not visible" in proc.stdout, proc.stdout
        assert os.path.isdir(upper), "the upper directory was only hidden from dedup"
