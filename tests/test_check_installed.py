"""ep_image/build_steps/check_installed.py's library check against real ELF files and the real
loader.

Every library here is built by gcc in the test: an extension reaching its dependency through
RUNPATH ``$ORIGIN`` outside site-packages, one whose dependency exists only as a same-named
decoy in another package, one whose dependency's dependency is missing, one that relies on
torch's libraries being loaded first. The expected answers are what the dynamic loader does
with such files, so each case would fail a check that guessed by file name.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from ep_image.build_steps import check_installed
from ep_image.native import loader

EXT = "deep_ep_cpp.cpython-311-x86_64-linux-gnu.so"

pytestmark = pytest.mark.skipif(
    shutil.which("gcc") is None, reason="needs gcc to build the ELF files under test"
)


def build_lib(
    path: Path, *, needs: tuple[Path, ...] = (), runpath: str | None = None, soname: str = ""
) -> Path:
    """A real shared library at ``path`` whose DT_NEEDED are the libraries ``needs``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    symbol = path.name.split(".")[0].replace("-", "_")
    calls = "".join(f"extern int f_{n.name.split('.')[0]}(void); " for n in needs)
    body = " + ".join(f"f_{n.name.split('.')[0]}()" for n in needs) or "0"
    source = path.with_suffix(".c")
    source.write_text(f"{calls}int f_{symbol}(void) {{ return 1 + {body}; }}\n")
    cmd = ["gcc", "-shared", "-fPIC", "-o", str(path), str(source), "-Wl,--no-as-needed"]
    cmd += [f"-Wl,-soname,{soname or path.name}"]
    for lib in needs:
        cmd += [f"-L{lib.parent}", f"-l:{lib.name}"]
    if runpath is not None:
        cmd += ["-Wl,--enable-new-dtags", f"-Wl,-rpath,{runpath}"]
    subprocess.run(cmd, check=True, capture_output=True)
    source.unlink()
    return path


@pytest.fixture
def site(tmp_path: Path) -> Path:
    path = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    path.mkdir(parents=True)
    return path


def check(site: Path) -> check_installed.Report:
    report = check_installed.Report(venv=str(site.parents[2]), backend="test")
    check_installed.resolve_extensions(site, report)
    return report


def test_runpath_origin_outside_site_packages_is_followed(site: Path) -> None:
    """RUNPATH $ORIGIN/../../../vendor (the venv's own vendor/): the loader finds it there."""
    vendor = build_lib(site.parents[2] / "vendor" / "libvendor.so")
    build_lib(site / EXT, needs=(vendor,), runpath="$ORIGIN/../../../vendor")
    report = check(site)
    assert report.problems == []
    where = report.extensions[EXT]["libvendor.so"]
    assert where is not None and Path(where).resolve() == vendor.resolve()


def test_a_same_named_decoy_elsewhere_satisfies_nothing(site: Path) -> None:
    """libnvshmem-like dependency absent from RUNPATH; a file of that name in another package."""
    scratch = build_lib(site.parent / "build" / "libdecoy.so")  # only to link against
    build_lib(site / EXT, needs=(scratch,), runpath="$ORIGIN/deep_ep/lib")
    shutil.rmtree(scratch.parent)
    build_lib(site / "otherpkg" / "libs" / "libdecoy.so")
    report = check(site)
    assert report.extensions[EXT]["libdecoy.so"] is None
    assert any("libdecoy.so" in p and "does not find" in p for p in report.problems)


def test_a_missing_dependency_is_a_problem_naming_the_fix(site: Path) -> None:
    scratch = build_lib(site.parent / "build" / "libgone.so")
    build_lib(site / EXT, needs=(scratch,))
    shutil.rmtree(scratch.parent)
    report = check(site)
    assert report.extensions[EXT]["libgone.so"] is None
    assert any("libgone.so" in p and "install the package" in p for p in report.problems)


def test_a_missing_dependency_of_a_dependency_is_a_problem(site: Path) -> None:
    scratch = build_lib(site.parent / "build" / "libdeep.so")
    middle = build_lib(site / "deep_ep" / "lib" / "libmiddle.so", needs=(scratch,))
    build_lib(site / EXT, needs=(middle,), runpath="$ORIGIN/deep_ep/lib")
    shutil.rmtree(scratch.parent)
    report = check(site)
    assert report.extensions[EXT]["libmiddle.so"] == str(middle)
    assert any("libdeep.so" in p and "one of its libraries" in p for p in report.problems)


def test_torch_libraries_loaded_first_satisfy_the_extension(site: Path) -> None:
    """libc10.so has no RUNPATH entry in the extension: `import torch` loaded it already."""
    c10 = build_lib(site / "torch" / "lib" / "libc10.so")
    torch_c = site / "torch" / "_C.cpython-311-x86_64-linux-gnu.so"
    build_lib(torch_c, needs=(c10,), runpath="$ORIGIN/lib")
    build_lib(site / EXT, needs=(c10,))
    report = check(site)
    assert report.problems == []
    assert report.extensions[EXT]["libc10.so"] == str(c10)

    # Without torch's extension module nothing loads torch/lib first: not found.
    torch_c.unlink()
    report = check(site)
    assert report.extensions[EXT]["libc10.so"] is None


def test_the_gpu_driver_may_be_missing_on_a_cpu_host(site: Path, tmp_path: Path) -> None:
    """libcuda.so.1 comes from the host's driver at run time; nothing else may be missing."""
    stub = build_lib(tmp_path / "stub" / "libcuda.so.1", soname="libcuda.so.1")
    build_lib(site / EXT, needs=(stub,))
    shutil.rmtree(stub.parent)
    report = check(site)
    where = report.extensions[EXT]["libcuda.so.1"]
    assert where == check_installed.DRIVER_WHERE or Path(str(where)).exists()
    assert report.problems == []


def test_no_extension_is_a_problem(site: Path) -> None:
    (site / "deep_ep").mkdir()
    assert any("no compiled deep_ep extension" in p for p in check(site).problems)


def test_the_loader_is_asked_not_guessed(site: Path) -> None:
    """ep_image.native.loader reads DT_NEEDED and DT_SONAME as the loader does (cross-checked
    with readelf)."""
    dep = build_lib(site / "x" / "libdep.so.3", soname="libdep.so.3")
    ext = build_lib(site / EXT, needs=(dep,), runpath="$ORIGIN/x")
    dynamic = loader.elf_dynamic(ext)
    assert "libdep.so.3" in dynamic.needed and dynamic.soname == EXT
    assert loader.elf_soname(dep) == "libdep.so.3"
    if shutil.which("readelf"):
        out = subprocess.run(["readelf", "-d", str(ext)], capture_output=True, text=True).stdout
        listed = [line.split("[")[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]
        assert listed == list(dynamic.needed)
    direct, deeper = loader.resolve(ext)
    assert direct["libdep.so.3"] == str(dep) and deeper == []
