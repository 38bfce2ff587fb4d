"""How much memory this process may still use, what it uses itself, and whether the kernel's
out-of-memory killer has ended processes: read from /proc and the process's memory cgroup.

Why: a job of N local ranks holds 2N Pythons that have imported torch (each rank's supervisor
and its backend process). Started where they cannot fit, the OOM killer ends processes one by
one and the run dies without a report (a 64-rank run on 24 GiB left 114 processes at load 70).
The launcher refuses what cannot fit before any rank starts, and a process the OOM killer ended
is reported as such, not as a crash. Standard library only.
"""

from __future__ import annotations

import os
from pathlib import Path

from ep_image.files import mounts

_CGROUP_V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes")
_CGROUP_V2 = ("memory.max", "memory.current")
#: A cgroup v1 limit this large means none (the kernel writes the largest page-aligned value).
_NO_LIMIT = 1 << 60


def _status_kib(field: str, pid: str = "self") -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def own_anonymous() -> int:
    """This process's anonymous resident memory (RssAnon): what another process that imported
    the same things needs of its own."""
    return (_status_kib("RssAnon") or 0) * 1024


def _cgroup_dirs() -> list[tuple[Path, tuple[str, str]]]:
    """This process's memory cgroup directory and those above it (each with the names of its
    limit and usage files), innermost first; none where there is no memory cgroup."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    table = mounts.mounts()
    found: list[tuple[Path, tuple[str, str]]] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            names, mount = _CGROUP_V2, next((m for m in table if m.fstype == "cgroup2"), None)
        elif "memory" in controllers.split(","):
            names = _CGROUP_V1
            v1 = (m for m in table if m.fstype == "cgroup" and "memory" in m.super_options)
            mount = next(v1, None)
        else:
            continue
        if mount is None:
            continue
        relative = os.path.relpath(path, mount.root) if path.startswith(mount.root) else path
        here = Path(mount.mount_point) / relative.lstrip("/")
        while True:
            if (here / names[0]).exists():
                found.append((here, names))
            if here == Path(mount.mount_point) or here == here.parent:
                break
            here = here.parent
        if found:
            return found
    return found


def available() -> tuple[int, str]:
    """Bytes this process and its children may still take, and from where that was read: the
    machine's MemAvailable, or less where a memory cgroup's limit leaves less."""
    best, source = 0, "the machine's MemAvailable"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                best = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        best = 0
    for directory, (limit_name, usage_name) in _cgroup_dirs():
        try:
            limit_text = (directory / limit_name).read_text().strip()
            usage = int((directory / usage_name).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or int(limit_text) >= _NO_LIMIT:
            continue
        left = max(0, int(limit_text) - usage)
        if left < best or best == 0:
            best, source = left, f"the memory cgroup {directory} (limit {limit_text} bytes)"
    return best, source


def oom_kills() -> int | None:
    """How many processes the kernel's out-of-memory killer has ended so far, counted for this
    process's memory cgroup where it keeps a count, else for the machine; None if unknown."""
    for directory, names in _cgroup_dirs()[:1]:
        events = directory / ("memory.events" if names == _CGROUP_V2 else "memory.oom_control")
        try:
            for line in events.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
    try:
        for line in Path("/proc/vmstat").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None
