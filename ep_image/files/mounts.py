"""The mounts this process sees (``/proc/self/mountinfo``): which mount holds a path, which mount
points lie inside a tree, and an overlay's layers.

Why: a path string does not say which tree it is. A bind mount makes one directory reachable by
two paths, a mount inside a tree makes another tree part of it, and a container layer
(overlayfs) holds only what was written in it while ``du`` of the merged view counts every
layer. tree_sync and dedup ask here before they write. Standard library only.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

MOUNTINFO = "/proc/self/mountinfo"
_OCTAL = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True)
class Mount:
    """One line of mountinfo: where it is mounted, what, and with which options."""

    mount_point: str
    fstype: str
    device: tuple[int, int]  # st_dev's major:minor of the mounted file system
    root: str  # the directory of that file system mounted here ("/" unless a bind mount)
    super_options: str
    mount_id: int = -1  # the kernel's id of this mount (-1: not read from mountinfo)

    def option(self, name: str) -> str | None:
        """A per-superblock option's value (``upperdir`` of an overlay), unescaped."""
        for item in _split_options(self.super_options):
            key, _, value = item.partition("=")
            if key == name:
                return value
        return None


def _unescape(text: str) -> str:
    """mountinfo writes space, tab, newline and backslash in a path as octal escapes."""
    return _OCTAL.sub(lambda m: chr(int(m[1], 8)), text)


def _split_options(text: str) -> list[str]:
    """Comma-separated options; overlayfs escapes a comma inside a path with a backslash."""
    items, current, escaped = [], "", False
    for char in text:
        if escaped:
            current, escaped = current + char, False
        elif char == "\\":
            escaped = True
        elif char == ",":
            items.append(current)
            current = ""
        else:
            current += char
    items.append(current)
    return items


def parse(text: str) -> list[Mount]:
    """The mounts of a mountinfo text, in its order (later mounts cover earlier ones)."""
    found = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        major, _, minor = fields[2].partition(":")
        found.append(
            Mount(
                mount_point=_unescape(fields[4]),
                fstype=tail[0],
                device=(int(major), int(minor)),
                root=_unescape(fields[3]),
                super_options=_unescape(tail[2]),
                mount_id=int(fields[0]) if fields[0].isdigit() else -1,
            )
        )
    return found


def mounts() -> list[Mount]:
    """The mounts this process sees; none where mountinfo cannot be read (not Linux)."""
    try:
        return parse(Path(MOUNTINFO).read_text(errors="surrogateescape"))
    except OSError:
        return []


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def mount_of(path: str | os.PathLike[str], table: list[Mount] | None = None) -> Mount | None:
    """The mount that holds ``path`` (resolved): the last one mounted over its longest prefix."""
    real = os.path.realpath(path)
    best: Mount | None = None
    for mount in mounts() if table is None else table:
        if _under(real, mount.mount_point) and (
            best is None or len(mount.mount_point) >= len(best.mount_point)
        ):
            best = mount
    return best


def inside(path: str | os.PathLike[str], table: list[Mount] | None = None) -> list[str]:
    """Mount points strictly inside the tree at ``path`` (resolved): other trees in it."""
    real = os.path.realpath(path)
    found = {
        m.mount_point
        for m in (mounts() if table is None else table)
        if m.mount_point != real and _under(m.mount_point, real)
    }
    return sorted(found)


def mount_id_of(path: str | os.PathLike[str]) -> int | None:
    """The kernel's id of the mount that holds ``path`` (``mnt_id`` of an fd opened on it), or
    None where /proc cannot say. Unlike a longest-prefix match of mount points, it is right
    where mounts are stacked on one point or a path's mount was covered after it was opened."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except (OSError, AttributeError):
        return None
    try:
        with open(f"/proc/self/fdinfo/{fd}") as info:
            for line in info:
                key, _, value = line.partition(":")
                if key == "mnt_id":
                    return int(value)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return None


def aliases(path: str | os.PathLike[str], table: list[Mount] | None = None) -> list[str]:
    """Every path by which the file or directory at ``path`` (resolved, listed first) can be
    reached here: where its file system, or a directory above it in that file system, is also
    mounted (a bind mount). Each path is confirmed by device and inode; a mount's ``root`` says
    where in its file system the mounted tree lies, which no path string says."""
    real = os.path.realpath(path)
    st = os.stat(real)
    table = mounts() if table is None else table
    wanted = mount_id_of(real)
    here = next((m for m in table if m.mount_id == wanted), None) if wanted is not None else None
    here = here or mount_of(real, table)
    if here is None or here.root.endswith("//deleted"):
        return [real]
    # Where ``path`` lies inside its file system: the mount's root, then the way down to it.
    inner = os.path.normpath(os.path.join(here.root, os.path.relpath(real, here.mount_point)))
    found = [real]
    for mount in table:
        if mount.device != here.device or not _under(inner, mount.root):
            continue
        rest = os.path.relpath(inner, mount.root)
        candidate = os.path.normpath(os.path.join(mount.mount_point, rest))
        if candidate in found:
            continue
        try:
            other = os.stat(candidate)
        except OSError:
            continue  # covered by another mount, or not reachable from here
        if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
            found.append(candidate)
    return found
