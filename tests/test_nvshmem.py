"""ep_image/build_steps/_source_builds/nvshmem.py: HybridEP's NVSHMEM set-up, against real ELF
files and the real loader.

The extension and the NVSHMEM library are compiled here with the host's C compiler the way
HybridEP's setup.py links them (``-l:libnvshmem_host.so``, ``-rpath $NVSHMEM_DIR/lib``, plus the
LDFLAGS make_venv adds); ``ldd`` (the real dynamic loader) then shows where the library resolves
once the venv has moved away from the directory it was built in.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from ep_image.build_steps._source_builds import nvshmem

ROOT = Path(__file__).resolve().parents[1]


CC = shutil.which("cc") or shutil.which("gcc")
needs_cc = pytest.mark.skipif(
    CC is None,
    reason="needs a C compiler (python3 scripts/bootstrap.py --tests installs gcc)",
)


def fake_venv(root: Path, with_nvshmem: bool = True) -> Path:
    """A venv layout with (optionally) nvidia/nvshmem/lib/libnvshmem_host.so.3 in it."""
    site = root / "lib" / "python3.12" / "site-packages"
    lib = site / "nvidia" / "nvshmem" / "lib"
    lib.mkdir(parents=True)
    if with_nvshmem:
        (root / "stub.c").write_text("int nvshmem_stub(void) { return 3; }\n")
        target = lib / "libnvshmem_host.so.3"
        cmd = [CC, "-shared", "-fPIC", "-Wl,-soname,libnvshmem_host.so.3", "-o", str(target)]
        subprocess.run([*cmd, str(root / "stub.c")], check=True)
    return root


def link_like_setup_py(venv: Path, env: dict[str, str]) -> Path:
    """deep_ep_cpp.so as HybridEP's setup.py links it, with the LDFLAGS make_venv passes."""
    site = next(venv.glob("lib/python3*/site-packages"))
    (venv / "ext.c").write_text(
        "int nvshmem_stub(void);\nint ext(void) { return nvshmem_stub(); }\n"
    )
    out = site / "deep_ep_cpp.cpython-312-x86_64-linux-gnu.so"
    lib = f"{env['NVSHMEM_DIR']}/lib"
    cmd = [CC, "-shared", "-fPIC", "-o", str(out), str(venv / "ext.c"), f"-L{lib}"]
    cmd += ["-l:libnvshmem_host.so", f"-Wl,-rpath,{lib}", *env.get("LDFLAGS", "").split()]
    subprocess.run(cmd, check=True)
    return out


@needs_cc
def test_set_up_build_check_and_the_loader_after_a_rename(tmp_path: Path) -> None:
    venv = fake_venv(tmp_path / ".hybridep.tmp-1234")
    env = nvshmem.build_environment(venv, {"LDFLAGS": "-O1"})
    lib = Path(env["NVSHMEM_DIR"]) / "lib"
    assert Path(env["NVSHMEM_DIR"]) == venv / "lib/python3.12/site-packages/nvidia/nvshmem"
    assert (lib / "libnvshmem_host.so").resolve() == lib / "libnvshmem_host.so.3"
    assert env["LDFLAGS"] == "-O1 -Wl,-rpath,$ORIGIN/nvidia/nvshmem/lib"
    nvshmem.build_environment(venv, {})  # a second call replaces the link, no error

    extension = link_like_setup_py(venv, env)
    dynamic = nvshmem.read_dynamic(extension)
    assert "libnvshmem_host.so.3" in dynamic.needed
    assert dynamic.runpath == (str(lib), "$ORIGIN/nvidia/nvshmem/lib")
    record = nvshmem.check_extension(venv)
    assert record["resolves_to"] == "nvidia/nvshmem/lib/libnvshmem_host.so.3"

    # make_venv renames the venv into place: the absolute entry dies, $ORIGIN still resolves.
    final = venv.rename(tmp_path / "hybridep")
    moved = next(final.glob("lib/python3*/site-packages/deep_ep_cpp*.so"))
    ldd = subprocess.run(["ldd", str(moved)], capture_output=True, text=True, check=True).stdout
    resolved = next(line for line in ldd.splitlines() if "libnvshmem_host.so.3" in line)
    assert f"{final}/lib/python3.12/site-packages/nvidia/nvshmem/lib/" in resolved, ldd


@needs_cc
def test_an_extension_without_the_runpath_is_refused_with_the_fix(tmp_path: Path) -> None:
    """What a wheel from uv's cache, built without make_venv's set-up, looks like."""
    venv = fake_venv(tmp_path / "venv")
    env = nvshmem.build_environment(venv, {})
    link_like_setup_py(venv, {"NVSHMEM_DIR": env["NVSHMEM_DIR"]})
    with pytest.raises(nvshmem.NvshmemError, match=r"uv cache clean deep-ep"):
        nvshmem.check_extension(venv)


@needs_cc
def test_cuda_13s_cccl_headers_go_on_cpath(tmp_path: Path) -> None:
    """CUDA 13 keeps libcu++ in include/cccl; NVSHMEM's host headers need it in .cpp builds."""
    venv = fake_venv(tmp_path / "venv")
    home = tmp_path / "cuda"
    (home / "include" / "cccl" / "cuda" / "std").mkdir(parents=True)
    env = nvshmem.build_environment(venv, {"CUDA_HOME": str(home), "CPATH": "/x"})
    assert env["CPATH"] == f"{home}/include/cccl:/x"
    assert "CPATH" not in nvshmem.build_environment(venv, {"CUDA_HOME": str(tmp_path / "none")})


def test_a_venv_without_nvshmem_names_the_skip_list(tmp_path: Path) -> None:
    venv = fake_venv(tmp_path / "venv", with_nvshmem=False)
    with pytest.raises(nvshmem.NvshmemError, match="VENV_SKIP_PACKAGES"):
        nvshmem.build_environment(venv, {})


def test_a_missing_extension_is_an_error(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "lib" / "python3.12" / "site-packages").mkdir(parents=True)
    with pytest.raises(nvshmem.NvshmemError, match="without its NVSHMEM extension"):
        nvshmem.check_extension(venv)


def test_non_elf_is_named(tmp_path: Path) -> None:
    path = tmp_path / "x.so"
    path.write_bytes(b"not an elf")
    with pytest.raises(nvshmem.NvshmemError, match="not a 64-bit little-endian ELF"):
        nvshmem.read_dynamic(path)
