"""Directories a test run makes under a shared parent, and the removal of those a killed run left.

Why: the image tests' buildah storages and dockerd state go under EP_IMAGE_TEST_STORE_PARENT
(.ci/run's run directory, removed whatever happens) or, in a plain pytest run, the test cache.
A run killed with SIGKILL cannot remove its own: one left 6.3 GB there, a network namespace
still mounted in it; another 13 GB, with dockerd's directories under /run and the build
secrets. Each directory holds a lock its run keeps until the directory is gone; a later run
removes every directory whose lock nobody holds, after stopping the processes that still name
it and unmounting what is mounted under it, and then what the dead run left outside it (its
``leftovers``: for a dockerd, tests/_docker_engine.py's). Every run does so as it starts
(``sweep_killed_runs``, from conftest.py), and each directory's maker again before it makes one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from _buildah import CACHE, unmount_under

#: The lock file in each owned directory; held (flock) by the run that made it.
LOCK = ".owner.lock"


@dataclass
class Outside:
    """What a dead run left outside its directory, found from what the directory holds (so
    only while it is there): processes that do not name it (a container's), entries to remove
    (a container's state, a socket), cgroups to remove once their processes are gone, and the
    directories the run made (under /run), each removed when it is empty."""

    pids: list[int] = field(default_factory=list)
    entries: list[Path] = field(default_factory=list)
    cgroups: list[Path] = field(default_factory=list)
    made: list[Path] = field(default_factory=list)


#: What a directory's kind of run leaves outside it: read from the directory before it goes.
Leftovers = Callable[[Path], Outside]


@dataclass
class Owned:
    """A directory this process owns: ``release()`` after removing it."""

    path: Path
    fd: int

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def make(parent: Path, prefix: str, leftovers: Leftovers | None = None) -> Owned:
    """A new directory ``parent/prefix*`` owned by this process, after sweeping the ones of
    dead runs. The lock is taken before its file appears in the directory (a rename), so a
    concurrent sweep never sees an unlocked lock file of a live run."""
    sweep(parent, prefix, leftovers)
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    pending = path / f"{LOCK}.new"
    fd = os.open(pending, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(pending, path / LOCK)
    return Owned(path, fd)


def sweep(parent: Path, prefix: str, leftovers: Leftovers | None = None) -> list[Path]:
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
            remove(path, leftovers)
            removed.append(path)
        finally:
            os.close(fd)
    return removed


def remove(path: Path, leftovers: Leftovers | None = None) -> None:
    """Stop what still names ``path`` (a dockerd, its containerd and shims, a buildah) and what
    ``leftovers`` finds outside it (a container's processes), unmount what is mounted under it,
    deepest first, remove it, then what it left outside."""
    outside = Outside()
    if leftovers is not None:
        try:
            outside = leftovers(path)
        except (OSError, ValueError) as exc:  # never keep the directory for want of the rest
            print(f"_owned_dirs: what {path} left outside it is unknown: {exc}", file=sys.stderr)
    stop(sorted({*naming(path), *outside.pids}))
    unmount_under(path)
    subprocess.run(["rm", "-rf", "--one-file-system", str(path)], check=False)
    for entry in outside.entries:
        subprocess.run(["rm", "-rf", "--one-file-system", str(entry)], check=False)
    for cgroup in sorted(outside.cgroups, key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            cgroup.rmdir()  # a cgroup goes with rmdir once no process is left in it
    remove_made(outside.made)


def remove_made(made: list[Path]) -> None:
    """Remove the directories a run made, deepest first, each only when empty; one made inside
    another made one only together with it, when it is all that one holds (so an empty
    /run/docker/plugins stays while a Docker that came later keeps its socket in /run/docker)."""
    chosen = set(made)
    for directory in sorted(chosen, key=lambda p: len(p.parts), reverse=True):
        try:
            if any(directory.iterdir()):
                continue
            if directory.parent in chosen and [p.name for p in directory.parent.iterdir()] != [
                directory.name
            ]:
                continue
            directory.rmdir()
        except OSError:
            continue


def parents() -> list[Path]:
    """The directories owned directories are made in, those that exist: EP_IMAGE_TEST_STORE_PARENT,
    the test cache, and the run directories of .ci/run in it (one whose script was killed
    before its clean-up). Sweeping one a live run uses is safe: its directories are locked."""
    found = [Path(p)] if (p := os.environ.get("EP_IMAGE_TEST_STORE_PARENT")) else []
    found += [CACHE, *sorted(CACHE.glob("ci-run.*"))]
    return [p for p in dict.fromkeys(found) if p.is_dir() and not p.is_symlink()]


def sweep_killed_runs(kinds: Mapping[str, Leftovers | None]) -> list[Path]:
    """At a run's start, before any test: remove what killed runs left in every parent, for
    each prefix of ``kinds`` with what such a run leaves outside its directory. Not only the
    module that makes such directories does it: a killed run's gigabytes, mounts and secrets
    must not wait for the next run of that module."""
    removed = []
    for parent in parents():
        for prefix, leftovers in kinds.items():
            removed += sweep(parent, prefix, leftovers)
    return removed


def naming(path: Path) -> list[int]:
    """Processes other than this one with ``path`` or a path under it among their arguments
    (a dockerd's containerd and shims, which detach from it, name its state directory)."""
    names = {bytes(path), os.path.realpath(path).encode()}  # a daemon may resolve symlinks
    unders = [name + b"/" for name in names]
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            args = (entry / "cmdline").read_bytes().split(b"\0")
            if any(a in names or any(u in a for u in unders) for a in args):
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
