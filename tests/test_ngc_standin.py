"""The NGC stand-in's driver stubs (tests/_ngc_standin.py), which the full image's DeepEP builds
link against: every entry point cuda.h declares, including the versioned names its macros
select, exported under the driver's soname, so the linker keeps libcuda.so.1 as a dependency."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from _ngc_standin import make_stub, stub_symbols

CUDA_H = Path("/usr/local/cuda/include/cuda.h")


def exported(library: Path) -> set[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


def test_stub_symbols_take_the_versioned_names_the_macros_select(tmp_path: Path) -> None:
    header = tmp_path / "api.h"
    header.write_text(
        "#define cuCtxCreate cuCtxCreate_v4\n"
        "CUresult CUDAAPI cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev);\n"
        "CUresult CUDAAPI cuInit(unsigned int Flags);\n"
        "typedef struct CUctx_st *CUcontext;\n"
    )
    assert stub_symbols(header, "cu") == ["cuCtxCreate", "cuCtxCreate_v4", "cuInit"]


@pytest.mark.skipif(not CUDA_H.is_file() or shutil.which("gcc") is None,
                    reason="needs a CUDA toolkit's cuda.h and gcc")  # fmt: skip
def test_the_libcuda_stub_exports_what_an_extension_links(tmp_path: Path) -> None:
    stub = tmp_path / "libcuda.so"
    count = make_stub(CUDA_H, "cu", "libcuda.so.1", stub)
    symbols = exported(stub)
    assert len(symbols) == count > 400
    # DeepEP's and HybridEP's kernels' host code calls these (TMA descriptors, VMM, launch).
    assert {
        "cuTensorMapEncodeTiled",
        "cuMemCreate",
        "cuLaunchKernelEx",
        "cuGetProcAddress_v2",
    } <= symbols
    soname = subprocess.run(["objdump", "-p", str(stub)], capture_output=True, text=True).stdout
    assert "SONAME               libcuda.so.1" in soname
    # A library linked against it keeps the dependency (the ABI check reads it).
    user = tmp_path / "user.c"
    user.write_text("int cuInit(unsigned int); int probe(void) { return cuInit(0); }\n")
    lib = tmp_path / "libuser.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,--as-needed", "-o", str(lib), str(user),
                    f"-L{tmp_path}", "-lcuda"], check=True)  # fmt: skip
    needed = subprocess.run(["objdump", "-p", str(lib)], capture_output=True, text=True).stdout
    assert "NEEDED               libcuda.so.1" in needed
