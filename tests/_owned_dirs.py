"""Directories a test run makes under a shared parent, and the removal of those a killed run left.

Why: the image tests' buildah storages and dockerd state go under EP_IMAGE_TEST_STORE_PARENT
(.ci/run's run directory, removed whatever happens) or, in a plain pytest run, the test cache.
A run killed with SIGKILL cannot remove its own: one left 6.3 GB there, a network namespace
still mounted in it. Each directory holds a lock its run keeps until the directory is gone; a
later run removes every directory whose lock nobody holds, after stopping the processes that
still name it and unmounting what is mounted under it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from _buildah import unmount_under

#: The lock file in each owned directory; held (flock) by the run that made it.
LOCK = ".owner.lock"


@dataclass
class Owned:
    """A directory this process owns: ``release()`` after removing it."""

    path: Path
    fd: int

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def make(parent: Path, prefix: str) -> Owned:
    """A new directory ``parent/prefix*`` owned by this process, after sweeping the ones of
    dead runs. The lock is taken before its file appears in the directory (a rename), so a
    concurrent sweep never sees an unlocked lock file of a live run."""
    sweep(parent, prefix)
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    pending = path / f"{LOCK}.new"
    fd = os.open(pending, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(pending, path / LOCK)
    return Owned(path, fd)


def sweep(parent: Path, prefix: str) -> list[Path]:
    """Remove each ``parent/prefix*`` directory whose lock nobody holds: its run is dead.
    Directories without a lock file (made by older code, or mid-creation) are left alone."""
    removed = []
    for path in sorted(parent.glob(f"{prefix}*")):
        lock = path / LOCK
        if path.is_symlink() or not path.is_dir() or not lock.is_file():
            continue
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live run holds it
            remove(path)
            removed.append(path)
        finally:
            os.close(fd)
    return removed


def remove(path: Path) -> None:
    """Stop what still names ``path`` (a dockerd, its containerd and shims, a buildah), unmount
    what is mounted under it, deepest first, and remove it."""
    stop(naming(path))
    unmount_under(path)
    subprocess.run(["rm", "-rf", "--one-file-system", str(path)], check=False)


def naming(path: Path) -> list[int]:
    """Processes other than this one with ``path`` or a path under it among their arguments
    (a dockerd's containerd and shims, which detach from it, name its state directory)."""
    under = f"{path}/".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            args = (entry / "cmdline").read_bytes().split(b"\0")
            if any(a == bytes(path) or under in a for a in args):
                found.append(int(entry.name))
    return found


def stop(pids: list[int], grace: float = 10) -> None:
    """SIGTERM, then SIGKILL to those still alive after ``grace`` seconds."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in pids:
        if alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    """Running, not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
