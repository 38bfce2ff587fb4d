"""The dynamic section of an ELF shared object: what the loader reads to find its libraries.

Why here: the build (the NVSHMEM runpath check), the loader-based install check and the probes'
internode facts all ask an extension which libraries it needs (DT_NEEDED), where it looks
(DT_RUNPATH, else DT_RPATH) and what it is called (DT_SONAME), in images and venvs that may have
no binutils. One reader serves them all. Standard library only; 64-bit little-endian files.
"""

from __future__ import annotations

import os
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
    # Only the headers, the dynamic segment and its strings are read, never the whole file: a
    # venv's check reads hundreds of libraries, some of a gigabyte (libtorch, cuDNN).
    with open(path, "rb") as file:
        return _parse(file.fileno(), path)


def _parse(fd: int, path: str | Path) -> Dynamic:
    def at(offset: int, size: int) -> bytes:
        data = os.pread(fd, size, offset)
        if len(data) != size:
            raise ValueError(f"{size} bytes at {offset} run past the end of the file")
        return data

    header = os.pread(fd, 64, 0)
    if header[:4] != b"\x7fELF" or len(header) < 64 or header[4] != 2 or header[5] != 1:
        raise ElfError(f"{path} is not a 64-bit little-endian ELF file")
    try:
        (phoff,) = struct.unpack_from("<Q", header, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", header, 0x36)
        table = at(phoff, phnum * phentsize)
        loads: list[tuple[int, int, int]] = []
        dynamic: tuple[int, int] | None = None
        for i in range(phnum):
            p_type, _flags, p_offset, p_vaddr, _paddr, p_filesz = struct.unpack_from(
                "<IIQQQQ", table, i * phentsize
            )
            if p_type == _PT_LOAD:
                loads.append((p_vaddr, p_offset, p_filesz))
            elif p_type == _PT_DYNAMIC:
                dynamic = (p_offset, p_filesz)
        if dynamic is None:
            return Dynamic()
        segment = at(dynamic[0], dynamic[1] - dynamic[1] % 16)
        entries: list[tuple[int, int]] = []
        for offset in range(0, len(segment), 16):
            tag, value = struct.unpack_from("<qQ", segment, offset)
            if tag == _DT_NULL:
                break
            entries.append((tag, value))
        strtab_vaddr = next(value for tag, value in entries if tag == _DT_STRTAB)
        strtab = next(
            off + strtab_vaddr - va for va, off, size in loads if va <= strtab_vaddr < va + size
        )

        def string(index: int) -> str:
            start, chunks = strtab + index, b""
            while b"\0" not in chunks:
                chunk = os.pread(fd, 256, start + len(chunks))
                if not chunk:
                    raise ValueError(f"the string at {start} has no end")
                chunks += chunk
            return chunks[: chunks.index(b"\0")].decode("utf-8", "replace")

        needed = tuple(string(v) for t, v in entries if t == _DT_NEEDED)
        paths = [string(v) for t, v in entries if t == _DT_RUNPATH]
        paths = paths or [string(v) for t, v in entries if t == _DT_RPATH]
        soname = next((string(v) for t, v in entries if t == _DT_SONAME), None)
    except (struct.error, StopIteration, ValueError) as exc:
        raise ElfError(f"{path}: unreadable dynamic section ({exc})") from None
    runpath = tuple(part for item in paths for part in item.split(":") if part)
    return Dynamic(needed, runpath, soname)
