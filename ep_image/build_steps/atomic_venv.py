"""One build of a venv per prefix at a time, under a temporary name, renamed into place when done.

Why: ``use-ep`` and the probes must never see a half-built ``<prefix>/<backend>``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ep_image.build_steps.uv_run import BuildError


def stale_temp_dirs(prefix: Path, backend: str) -> list[Path]:
    """What an interrupted run of this backend left in the prefix: its temporary build dir, or
    the replaced venv a kill during the final rename kept (``move_into_place``)."""
    found = [*prefix.glob(f".{backend}.tmp-*"), *prefix.glob(f".{backend}.old-*")]
    return sorted(p for p in found if p.is_dir() and not p.is_symlink())


def remove_stale(prefix: Path, backend: str) -> None:
    """Remove what an interrupted build of ``backend`` left (under the lock: none is live)."""
    for stale in stale_temp_dirs(prefix, backend):
        print(f"make_venv: removing {stale} left by an interrupted build", flush=True)
        shutil.rmtree(stale)


def lock_path(prefix: Path, backend: str) -> Path:
    return prefix / f".make_venv-{backend}.lock"


@contextlib.contextmanager
def building(prefix: Path, backend: str) -> Iterator[None]:
    """Hold ``<prefix>/.make_venv-<backend>.lock`` while ``backend`` is built there.

    Why: a second build of the same venv into the same prefix would take the first one's live
    temporary directory for an interrupted build's and delete it. It fails at once instead,
    naming the build that holds the lock. The file is removed when the build ends; a lock taken
    on a file that was removed meanwhile is retaken on the new one.
    """
    path = lock_path(prefix, backend)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise BuildError(
                f"{backend}: another make_venv (pid {holder}) is building it into {prefix}. "
                "Fix: wait for that build to end, or build into another --prefix"
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)


def prepare_prefix(prefix: Path) -> None:
    """Make ``prefix`` or say, in one line, why it cannot be used."""
    try:
        if prefix.exists() and not prefix.is_dir():
            raise BuildError(f"--prefix {prefix} is a file, not a directory. Fix: pass a directory")
        prefix.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BuildError(
            f"cannot create --prefix {prefix}: {exc.strerror}. Fix: pass a directory you can "
            "write, or create it with the right owner first"
        ) from None
    if not os.access(prefix, os.W_OK | os.X_OK):
        raise BuildError(
            f"--prefix {prefix} is not writable by this user. Fix: pass a directory you can "
            "write (e.g. under $HOME or a scratch file system), or fix its permissions"
        )


def new_temp_dir(prefix: Path, backend: str) -> Path:
    """A fresh name ``<prefix>/.<backend>.tmp-XXXX`` that uv venv will create."""
    path = Path(tempfile.mkdtemp(prefix=f".{backend}.tmp-", dir=prefix))
    path.rmdir()
    return path


def assert_relocated(venv: Path, temp_name: str) -> None:
    """No script in bin/ may name the temporary directory (it is about to be renamed): uv's
    relocatable venvs embed no absolute path of their own."""
    offenders = []
    for path in [*(venv / "bin").iterdir(), venv / "pyvenv.cfg"]:
        small_file = path.is_file() and not path.is_symlink() and path.stat().st_size < 1 << 20
        if small_file and temp_name.encode() in path.read_bytes():
            offenders.append(path.name)
    if offenders:
        raise BuildError(
            f"files in the venv embed its temporary path {temp_name}: {offenders}; "
            "this uv does not honour relocatable venvs for them (upgrade uv)"
        )


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def exchange(a: Path, b: Path) -> bool:
    """Swap the two paths in one step (renameat2 with RENAME_EXCHANGE): no moment exists at
    which either is missing. False where the kernel or file system cannot (then nothing moved)."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    rc = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def move_into_place(temp: Path, final: Path) -> None:
    """Put the finished venv at its final name, replacing an older one only now and in one
    step: the two are exchanged, so ``final`` is always a whole venv (the old one, then the new
    one), and ``temp`` then holds the old venv, which is removed. Where the file system cannot
    exchange, the old venv is renamed aside first (a kill between the two renames leaves it as
    ``.<name>.old-*``, which the next build removes)."""
    if not final.exists():
        os.rename(temp, final)
        return
    if exchange(temp, final):
        shutil.rmtree(temp)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
    old.rmdir()
    os.rename(final, old)
    os.rename(temp, final)
    shutil.rmtree(old)
