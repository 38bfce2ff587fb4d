"""The dynamic section of an ELF shared object: what the loader reads to find its libraries.

Why here: the build (the NVSHMEM runpath check), the loader-based install check and the probes'
internode facts all ask an extension which libraries it needs (DT_NEEDED), where it looks
(DT_RUNPATH, else DT_RPATH) and what it is called (DT_SONAME), in images and venvs that may have
no binutils. One reader serves them all. Standard library only; 64-bit little-endian files.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

_PT_LOAD, _PT_DYNAMIC = 1, 2
_DT_NULL, _DT_NEEDED, _DT_STRTAB, _DT_SONAME, _DT_RPATH, _DT_RUNPATH = 0, 1, 5, 14, 15, 29


class ElfError(ValueError):
    """Not a 64-bit little-endian ELF shared object, or one whose dynamic section is unreadable."""


@dataclass(frozen=True)
class Dynamic:
    """The entries of the dynamic section the loader uses."""

    needed: tuple[str, ...] = ()  # DT_NEEDED, in order
    runpath: tuple[str, ...] = ()  # DT_RUNPATH (or DT_RPATH), split on ':'
    soname: str | None = None  # DT_SONAME


def read_dynamic(path: str | Path) -> Dynamic:
    """Read from the dynamic segment, its string table located through the PT_LOAD segments
    that map it (as the loader does; section headers may be stripped). An ELF file without a
    dynamic segment (a static executable) has an empty one."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or len(data) < 64 or data[4] != 2 or data[5] != 1:
        raise ElfError(f"{path} is not a 64-bit little-endian ELF file")
    try:
        (phoff,) = struct.unpack_from("<Q", data, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
        loads: list[tuple[int, int, int]] = []
        dynamic: tuple[int, int] | None = None
        for i in range(phnum):
            p_type, _flags, p_offset, p_vaddr, _paddr, p_filesz = struct.unpack_from(
                "<IIQQQQ", data, phoff + i * phentsize
            )
            if p_type == _PT_LOAD:
                loads.append((p_vaddr, p_offset, p_filesz))
            elif p_type == _PT_DYNAMIC:
                dynamic = (p_offset, p_filesz)
        if dynamic is None:
            return Dynamic()
        entries: list[tuple[int, int]] = []
        for offset in range(dynamic[0], dynamic[0] + dynamic[1], 16):
            tag, value = struct.unpack_from("<qQ", data, offset)
            if tag == _DT_NULL:
                break
            entries.append((tag, value))
        strtab_vaddr = next(value for tag, value in entries if tag == _DT_STRTAB)
        strtab = next(
            off + strtab_vaddr - va for va, off, size in loads if va <= strtab_vaddr < va + size
        )

        def string(index: int) -> str:
            end = data.index(b"\0", strtab + index)
            return data[strtab + index : end].decode("utf-8", "replace")

        needed = tuple(string(v) for t, v in entries if t == _DT_NEEDED)
        paths = [string(v) for t, v in entries if t == _DT_RUNPATH]
        paths = paths or [string(v) for t, v in entries if t == _DT_RPATH]
        soname = next((string(v) for t, v in entries if t == _DT_SONAME), None)
    except (struct.error, StopIteration, ValueError) as exc:
        raise ElfError(f"{path}: unreadable dynamic section ({exc})") from None
    runpath = tuple(part for item in paths for part in item.split(":") if part)
    return Dynamic(needed, runpath, soname)
