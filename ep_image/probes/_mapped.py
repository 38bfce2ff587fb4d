"""The files mapped into this process (``/proc/<pid>/maps``): which shared objects the loader
actually chose, which is the whole question when two copies of a library exist.
"""

from __future__ import annotations

import os
import re
from pathlib import Path


def parse_maps(text: str) -> list[str]:
    """File paths mapped into a process, in first-seen order, from ``/proc/<pid>/maps`` text.

    Each maps line is ``address perms offset dev inode [path]``; anonymous and pseudo entries
    (``[heap]``, ``[vdso]``) are dropped. Paths may contain spaces, so the path is everything
    after the inode field.
    """
    seen: dict[str, None] = {}
    for line in text.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) < 6:
            continue
        path = parts[5].strip()
        if path.endswith(" (deleted)"):
            path = path[: -len(" (deleted)")]
        if path.startswith("/"):
            seen.setdefault(path, None)
    return list(seen)


def mapped_libraries(pattern: str, maps_text: str | None = None) -> list[str]:
    """Mapped files whose base name matches the regex ``pattern`` (``^libcudnn\\.so``)."""
    if maps_text is None:
        try:
            maps_text = Path("/proc/self/maps").read_text()
        except OSError:
            return []
    regex = re.compile(pattern)
    return [path for path in parse_maps(maps_text) if regex.search(os.path.basename(path))]
