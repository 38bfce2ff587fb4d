"""ep_image/native/elf.py against real shared objects built here with gcc, and binutils' own
reading.

Why: make_venv's ABI check and check-installed read the dynamic section of every library a venv
holds (hundreds, libtorch and cuDNN among them, each up to a gigabyte); reading whole files made
one NCCL EP venv's check take half a minute. These pin what is read and how much of the file.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ep_image.native import elf

pytestmark = pytest.mark.skipif(
    not (shutil.which("gcc") and shutil.which("readelf")), reason="needs gcc and binutils"
)


@pytest.fixture
def library(tmp_path: Path) -> Path:
    """libx.so.1, needing libdep.so, with a runpath and a soname."""
    (tmp_path / "dep.c").write_text("int dep(void) { return 1; }\n")
    (tmp_path / "x.c").write_text("int dep(void);\nint x(void) { return dep(); }\n")
    cc = ["gcc", "-shared", "-fPIC", "-o"]
    subprocess.run([*cc, "libdep.so", "dep.c"], cwd=tmp_path, check=True)
    subprocess.run(
        [*cc, "libx.so.1", "x.c", "-L.", "-ldep", "-Wl,-soname,libx.so.1",
         "-Wl,--enable-new-dtags,-rpath,$ORIGIN/lib:/opt/ep/lib"],
        cwd=tmp_path, check=True,
    )  # fmt: skip
    return tmp_path / "libx.so.1"


def readelf(path: Path) -> elf.Dynamic:
    """The same entries as binutils prints them."""
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True).stdout
    values = {tag: re.findall(rf"\({tag}\)\s+\S+.*?\[(.*)\]", out) for tag in
              ("NEEDED", "RUNPATH", "SONAME")}  # fmt: skip
    runpath = tuple(p for item in values["RUNPATH"] for p in item.split(":") if p)
    return elf.Dynamic(tuple(values["NEEDED"]), runpath, next(iter(values["SONAME"]), None))


def bytes_read() -> int:
    """What this process has read through read(2) and pread(2) so far (/proc/self/io rchar)."""
    text = Path("/proc/self/io").read_text()
    return int(re.search(r"^rchar: (\d+)", text, re.MULTILINE)[1])  # type: ignore[index]


def test_the_dynamic_section_is_what_binutils_reads(library: Path) -> None:
    dynamic = elf.read_dynamic(library)
    assert dynamic == readelf(library)
    assert dynamic.needed[0] == "libdep.so"
    assert dynamic.runpath == ("$ORIGIN/lib", "/opt/ep/lib")
    assert dynamic.soname == "libx.so.1"


def test_a_gigabyte_library_is_read_by_its_headers_only(library: Path, tmp_path: Path) -> None:
    """Padded to 4 GiB (sparse: no disk), the answer is the same and under 1 MiB is read."""
    big = tmp_path / "libbig.so"
    shutil.copy(library, big)
    os.truncate(big, 4 << 30)
    before = bytes_read()
    assert elf.read_dynamic(big) == elf.read_dynamic(library)
    assert bytes_read() - before < (1 << 20)


def test_a_file_cut_short_is_named(library: Path, tmp_path: Path) -> None:
    """A library cut before its dynamic segment (a partial download): ElfError, not a crash."""
    cut = tmp_path / "libcut.so"
    cut.write_bytes(library.read_bytes()[:256])
    with pytest.raises(elf.ElfError, match=r"libcut\.so: unreadable dynamic section"):
        elf.read_dynamic(cut)
    empty = tmp_path / "libempty.so"
    empty.write_bytes(b"")
    with pytest.raises(elf.ElfError, match="not a 64-bit little-endian ELF file"):
        elf.read_dynamic(empty)
