"""HybridEP's compiled kernels as files: which names are finished kernels, whether a file is a
whole shared object, and how a copy is put in place so that nobody ever sees it half written.

Why a module of its own: HybridEP dlopens every ``.so`` in its directory, so the cache may hand
it only complete kernels; it checks each file before placing or loading it, and places every
copy through a temporary name (never ending in ``.so``) and a link or rename.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ep_image.files.trust import untrusted

#: A publisher's temporary file older than this was abandoned (a copy takes milliseconds).
TMP_MAX_AGE_S = 3600.0
# HybridEP's kernel keys are get_key()'s values joined by '-' (numbers, 0/1, uint8_t/uint16_t);
# the file nvcc writes first is "<key>-rank-<r>-node-<n>-<ns>-<comm_id>.so", renamed to
# "<key>.so" only after dlopen succeeded: only the renamed ones are complete kernels.
_KERNEL = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]*\.so")
_ET_DYN, _PT_LOAD = 3, 1
_CHUNK = 1 << 20


def is_kernel_name(name: str) -> bool:
    """A kernel HybridEP finished and renamed to its key, not nvcc's output in progress."""
    return bool(_KERNEL.fullmatch(name)) and "-rank-" not in name


def valid_kernel(path: Path) -> bool:
    """A complete 64-bit ELF shared object: every loaded segment and the section header
    table lie inside the file, so a truncated copy is refused before dlopen sees it."""
    try:
        with path.open("rb") as fh:
            return valid_kernel_fd(fh.fileno())
    except OSError:
        return False


def valid_kernel_fd(fd: int) -> bool:
    """``valid_kernel`` of the file open at ``fd`` (read with pread: its offset is untouched)."""
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 64, 0)
        if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            return False
        (e_type,) = struct.unpack_from("<H", head, 16)
        phoff, shoff = struct.unpack_from("<QQ", head, 0x20)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", head, 0x36)
        if e_type != _ET_DYN or phnum == 0 or phentsize < 56:
            return False
        if phoff + phnum * phentsize > size or shoff + shnum * shentsize > size:
            return False
        table = os.pread(fd, phnum * phentsize, phoff)
        for i in range(phnum):
            p_type, _flags, p_offset, _vaddr, _paddr, p_filesz = struct.unpack_from(
                "<IIQQQQ", table, i * phentsize
            )
            if p_type == _PT_LOAD and p_offset + p_filesz > size:
                return False
    except (OSError, struct.error):
        return False
    return True


#: Beside each kernel this cache published: its sha256, written by the publisher after the
#: kernel is in place. A kernel without one (or whose bytes do not match it) is not loaded.
PUBLISHED = ".published"


def sha256(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def sha256_fd(fd: int) -> str:
    """The sha256 of the file open at ``fd``, read from its start with pread."""
    digest, offset = hashlib.sha256(), 0
    while chunk := os.pread(fd, _CHUNK, offset):
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


def published_sha(directory: Path, name: str) -> str | None:
    """The sha256 this cache published ``name`` with, if its record is there and trusted."""
    record = directory / f"{name}{PUBLISHED}"
    try:
        if untrusted(record) is not None:
            return None
        value = json.loads(record.read_text()).get("sha256")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def mark_published(directory: Path, name: str, digest: str) -> None:
    """``name``'s record (its sha256), in place whole: a temporary file, then a rename."""
    tmp = directory / _temp_name(f"{name}{PUBLISHED}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps({"sha256": digest, "publisher_uid": os.geteuid()}) + "\n")
        os.rename(tmp, directory / f"{name}{PUBLISHED}")
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def kernels(directory: Path) -> Iterator[os.DirEntry[str]]:
    """The finished kernels in ``directory`` (regular files with a kernel's name)."""
    for entry in os.scandir(directory):
        if is_kernel_name(entry.name) and entry.is_file(follow_symlinks=False):
            yield entry


def _copy_bytes(src: Path | int, fd: int) -> None:
    """Copy ``src`` (a path, or a file open at that descriptor: read with pread) into ``fd``."""
    if isinstance(src, int):
        offset = 0
        while chunk := os.pread(src, _CHUNK, offset):
            offset += len(chunk)
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view) :]
        return
    with src.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view) :]


def _temp_name(name: str) -> str:
    # Never ends in .so: HybridEP loads every .so in its directory, and a warm start every
    # .so in the cache.
    return f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def place(
    src: Path | int,
    directory: Path,
    name: str,
    *,
    durable: bool,
    record: bool = False,
    expect: str | None = None,
) -> bool:
    """Put a copy of ``src`` (a path, or a file open at that descriptor) at ``directory/name``
    so that nobody ever sees it half written: a temporary file in the same directory, checked,
    then linked (or renamed) into place; ``record``: then its published record (its sha256);
    ``expect``: only when the copy's sha256 is that. False when ``name`` was there already
    (another rank won) or the copy was not complete, or not what was expected."""
    tmp = directory / _temp_name(name)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        try:
            _copy_bytes(src, fd)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        if not valid_kernel(tmp):
            return False
        digest = sha256(tmp) if record or expect else ""
        if expect is not None and digest != expect:
            return False
        try:
            os.link(tmp, directory / name)
        except FileExistsError:
            return False
        except OSError:
            # A filesystem without hard links: rename replaces atomically; both are whole.
            os.rename(tmp, directory / name)
        if record:
            mark_published(directory, name, digest)
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def clean_temps(directory: Path, now: float) -> None:
    """Remove the temporary files of publishers that died more than TMP_MAX_AGE_S ago."""
    for entry in os.scandir(directory):
        if entry.name.startswith(".") and entry.name.endswith(".tmp"):
            with contextlib.suppress(OSError):
                if now - entry.stat(follow_symlinks=False).st_mtime > TMP_MAX_AGE_S:
                    os.unlink(entry.path)


def write_record(directory: Path, name: str, data: dict[str, Any]) -> None:
    """``directory/name`` as JSON, written whole and once: the first writer wins."""
    if (directory / name).exists():
        return
    tmp = directory / _temp_name(name)
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    try:
        os.link(tmp, directory / name)
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
