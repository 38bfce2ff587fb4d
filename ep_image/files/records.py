"""Reports and records written safely: only over a regular file or at a new path, atomically,
and the digest by which a record names a file.

Why: every report and record is written to a temporary file and renamed over its path, which
replaces whatever was there. As root that could turn /dev/null into a file for every process,
or replace a symbolic link instead of writing where it points. ``cli.report_path`` checks this
before any work (``not_a_file``), ``write_json`` again when it writes. Standard library only.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

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


def write_json(
    path: Path, data: Any, *, sort_keys: bool = True, default: Any = None, fsync: bool = False
) -> Path:
    """Write ``data`` as indented JSON atomically (temporary file in the same directory, then
    rename), world-readable, so a reader never sees half a record. ``fsync``: on disk before the
    rename (a probe's report must survive the machine going down). RecordPathError, before
    anything is written, when something other than a regular file is at ``path``."""
    path = Path(path)
    if (why := not_a_file(path)) is not None:
        raise RecordPathError(why, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # records are for others to read; mkstemp makes 0600
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(data, indent=2, sort_keys=sort_keys, default=default) + "\n")
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        if (why := not_a_file(path)) is not None:  # put there while this one was written
            raise RecordPathError(why, path)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in chunks: how a record names the file it describes."""
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()
