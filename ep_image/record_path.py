"""Where a report or record may be written: only over a regular file, or at a new path.

Why: every report and record is written to a temporary file and renamed over its path, which
replaces whatever was there. As root that could turn /dev/null into a file for every process,
or replace a symbolic link instead of writing where it points. ``cli.report_path`` checks this
before any work, ``project.write_json`` again when it writes. Standard library only.
"""

from __future__ import annotations

import errno
import os
import stat

#: What a file type is called in a message (lstat's mode -> words).
_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
)


def not_a_file(path: str | os.PathLike[str]) -> str | None:
    """Why a report or record may not be written at ``path`` (None: it may): something is
    there that is not a regular file. A record is renamed over its path, which replaces what
    was there (a device node, as root, for every process; a symbolic link itself, not what it
    points to), and a write through a device or FIFO would not be a file either."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    if stat.S_ISREG(mode):
        return None
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return f"{path} is {kind}, not a regular file"


class RecordPathError(OSError):
    """A report's or record's path is taken by something that is not a regular file."""

    def __init__(self, why: str, path: str | os.PathLike[str]) -> None:
        super().__init__(errno.EEXIST, why, str(path))
        self.why = why

    def __str__(self) -> str:
        return (
            f"{self.why}: a report or record replaces what is at its path; give the path of a "
            "regular file or a new one"
        )
