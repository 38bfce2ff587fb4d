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
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ep_image.build_steps._uv.run import BuildError


def stale_temp_dirs(prefix: Path, backend: str) -> list[Path]:
    """What an interrupted run of this backend left in the prefix: its temporary build dir, or
    the replaced venv a kill between the first two renames of ``move_into_place`` kept."""
    found = [*prefix.glob(f".{backend}.tmp-*"), *prefix.glob(f".{backend}.old-*")]
    return sorted(p for p in found if p.is_dir() and not p.is_symlink())


def remove_stale(prefix: Path, backend: str) -> None:
    """Clear what an interrupted build of ``backend`` left (under the lock: none is live).

    A ``.<backend>.old-*`` with no ``<prefix>/<backend>`` is the whole venv a kill between the
    first two renames of ``move_into_place`` kept aside: it is put back, not deleted."""
    final = prefix / backend
    for stale in stale_temp_dirs(prefix, backend):
        if stale.name.startswith(f".{backend}.old-") and not os.path.lexists(final):
            print(
                f"make_venv: restoring {final} from {stale}, kept by an interrupted build",
                flush=True,
            )
            os.rename(stale, final)
            continue
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
#: The errors of a kernel or file system that cannot exchange two names (then nothing moved).
CANNOT_EXCHANGE = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)


def _renameat2(a: Path, b: Path, flags: int) -> None:
    """renameat2(2), an OSError on failure (ENOSYS where the C library lacks it)."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not in this C library", str(a), None, str(b))
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a), None, str(b))


def exchange(a: Path, b: Path) -> bool:
    """Swap the two paths in one step (renameat2 with RENAME_EXCHANGE): no moment exists at
    which either is missing. False where the kernel or file system cannot (then nothing moved)."""
    try:
        _renameat2(a, b, _RENAME_EXCHANGE)
    except OSError as exc:
        if exc.errno in CANNOT_EXCHANGE:
            return False
        raise
    return True


#: Signals that come from the CPU fault of this very process: holding them would hide a crash.
_SYNCHRONOUS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGTRAP}
#: Signals whose default is to do nothing: nothing to hold back.
_HARMLESS = {signal.SIGCHLD, signal.SIGCONT, signal.SIGURG, signal.SIGWINCH}


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold back every catchable signal (Ctrl-C, SIGTERM, SIGHUP, ...) for a few system calls:
    one sent meanwhile is delivered, and its handler runs, once they are done.

    In the main thread the handlers themselves are swapped for one that only notes the signal:
    a signal mask is per thread, and a process-directed signal goes to any thread that does
    not block it, whose handler then runs in the main thread all the same. Elsewhere (no
    handler can be set there) this thread's mask is all there is."""
    if threading.current_thread() is not threading.main_thread():
        before = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals() - _SYNCHRONOUS)
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)
        return
    pending: list[int] = []
    saved: dict[int, Any] = {}
    held = signal.valid_signals() - _SYNCHRONOUS - _HARMLESS - {signal.SIGKILL, signal.SIGSTOP}
    for signum in sorted(held):
        current = signal.getsignal(signum)
        if current is None or current == signal.SIG_IGN:
            continue  # a handler set outside Python cannot be put back; an ignored one stays
        with contextlib.suppress(OSError, ValueError):
            saved[signum] = signal.signal(signum, lambda n, _f: pending.append(n))
    try:
        yield
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(pending):
            signal.raise_signal(signum)  # now its own handler runs (or its default action)


def move_into_place(temp: Path, final: Path) -> None:
    """Put the finished venv at its final name, replacing an older one only now and in one
    step: the two are exchanged, so ``final`` is always a whole venv (the old one, then the new
    one), and ``temp`` then holds the old venv, which is removed (if that is interrupted, the
    caller removes ``temp``: the new venv stays in place).

    Where the file system cannot exchange, the old venv is renamed aside to ``.<name>.old-*``,
    the new one into place and the old one to ``temp``, with every catchable signal held back
    and the old venv put back if a step fails. Only SIGKILL between the first two renames can
    leave no ``final``; the next build then restores the ``.old-*`` (``remove_stale``)."""
    if not final.exists():
        os.rename(temp, final)
        return
    if not exchange(temp, final):
        _rename_around(temp, final)
    shutil.rmtree(temp)


def _rename_around(temp: Path, final: Path) -> None:
    """The three renames of ``move_into_place`` without an exchange; afterwards ``final`` is
    the new venv and ``temp`` the old one, or, on an error, ``final`` is the old venv again."""
    old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
    old.rmdir()
    with signals_held():
        try:
            os.rename(final, old)
            os.rename(temp, final)
            os.rename(old, temp)
        except BaseException:
            # Whatever step failed (or a handler of a signal that came just before the hold
            # raised), the old venv goes back where no venv is, else where the caller removes.
            if os.path.lexists(old):
                os.rename(old, temp if os.path.lexists(final) else final)
            raise
