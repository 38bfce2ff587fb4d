"""tests/gpu_venvs.py and tests/gpu_venvs_device.sh: venvs to a GPU machine in parts, here.

The GPU machine takes one part per call; the device script checks each against SHA256SUMS and
unpacks them in order while later calls bring the rest. Played here with small parts into a
temporary root: the venvs arrive whole, hardlinks kept, a corrupt part is never unpacked, and
the checkout the venvs' editable install names is linked to the repository there.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEVICE = ROOT / "tests" / "gpu_venvs_device.sh"


@pytest.fixture
def prefix(tmp_path: Path) -> Path:
    """Two venvs that share a file through a hardlink, as uv's cache links them."""
    prefix = tmp_path / "venvs"
    for name in ("alpha", "beta"):
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(prefix / name)],
                       check=True)  # fmt: skip
    shared = prefix / "alpha" / "lib" / "blob.bin"
    shared.write_bytes(os.urandom(300_000))
    os.link(shared, prefix / "beta" / "lib" / "blob.bin")
    (prefix / "beta" / "lib" / "own.txt").write_text("beta's own\n")
    return prefix


def pack(prefix: Path, out: Path) -> dict:
    cmd = [sys.executable, str(ROOT / "tests" / "gpu_venvs.py"), "pack", "--prefix", str(prefix),
           "--out", str(out), "--part-bytes", "65536", "--no-interpreter",
           "--no-rdma-core"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((out / "bundle.json").read_text())


def device(cmd: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(DEVICE), cmd, *args], capture_output=True, text=True,
                          timeout=120, check=False, env={**os.environ, **env})  # fmt: skip


def carry(out: Path, carried: Path, names: list[str]) -> None:
    """What one call brings: these files of the pack, in the carried directory."""
    carried.mkdir(exist_ok=True)
    for name in names:
        shutil.copy2(out / name, carried / name)


@pytest.mark.skipif(shutil.which("zstd") is None, reason="zstd is not installed")
def test_parts_arrive_one_per_call_and_unpack_whole(prefix: Path, tmp_path: Path) -> None:
    out, root, carried = tmp_path / "out", tmp_path / "root", tmp_path / "carried"
    root.mkdir()
    bundle = pack(prefix, out)
    parts = sorted(p.name for p in out.glob("part.[0-9][0-9][0-9]"))
    assert bundle["parts"] == len(parts) >= 3, bundle
    env = {"EP_GPU_STORE": str(tmp_path / "store"), "EP_GPU_ROOT": str(root),
           "EP_GPU_CARRIED": str(carried)}  # fmt: skip
    try:
        # The first call brings the checksums, the bundle's record, zstd and part 0.
        carry(out, carried, ["SHA256SUMS", "bundle.json", "zstd", parts[0]])
        first = device("receive", env)
        assert first.returncode == 0, first.stderr
        assert first.stdout.startswith(f"parts here: 1 of {len(parts)}"), first.stdout
        # A part damaged on the way is not taken: the unpacker waits for a good copy.
        damaged = bytearray((out / parts[1]).read_bytes())
        damaged[100] ^= 0xFF
        (carried / parts[1]).write_bytes(bytes(damaged))
        device("receive", env)
        waited = device("wait", env, "2")
        assert waited.returncode == 124 and "not unpacked" in waited.stdout, waited.stdout
        for part in parts[1:]:
            (tmp_path / "store" / f"{part}.ok").unlink(missing_ok=True)
            carry(out, carried, [part])
            assert device("receive", env).returncode == 0
        done = device("wait", env, "60")
        assert done.returncode == 0, done.stdout + done.stderr
    finally:  # the unpacker outlives each call by design; not this test
        pid_file = tmp_path / "store" / "unpack.pid"
        if pid_file.exists():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(pid_file.read_text()), signal.SIGKILL)
    landed = root / str(prefix).lstrip("/")
    for name in ("alpha", "beta"):
        assert (landed / name / "pyvenv.cfg").read_text() == (
            prefix / name / "pyvenv.cfg"
        ).read_text()
    blob = landed / "alpha" / "lib" / "blob.bin"
    assert blob.read_bytes() == (prefix / "alpha" / "lib" / "blob.bin").read_bytes()
    assert os.stat(blob).st_ino == os.stat(landed / "beta" / "lib" / "blob.bin").st_ino
    assert (landed / "beta" / "lib" / "own.txt").read_text() == "beta's own\n"
    # The venvs' editable install names the checkout they were built from: it leads here.
    source_root = root / bundle["source_root"].lstrip("/")
    assert source_root.is_symlink() and source_root.resolve() == ROOT
    assert not list(carried.iterdir())  # each carried file moved into the store
