"""HybridEP's JIT kernels kept across processes: a shared cache keyed on what they are built from.

HybridEP compiles its kernels with nvcc into a directory of each process's own and never shares
them (docs/backends.md, "HybridEP's JIT kernels"); ``prepare()`` fills this process's directory
from ``$EP_HYBRIDEP_JIT_CACHE`` before a ``HybridEPBuffer`` is built, ``publish()`` adds what it
compiled. The key is cache_key's, the per-process directories proc_dirs', the files placed whole
by kernel_files. Nothing here may fail a training job: every problem becomes one warning.
Standard library only: the probes load it inside backend venvs.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import shutil
import stat
import tempfile
import threading
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ep_image.backends.hybridep.cache_key import (
    KEY_RECORD,
    CacheOff,
    arch_label,
    cache_key,
    find_package,
)
from ep_image.backends.hybridep.kernel_files import (
    TMP_MAX_AGE_S,
    clean_temps,
    kernels,
    mark_published,
    place,
    published_sha,
    sha256,
    sha256_fd,
    valid_kernel,
    valid_kernel_fd,
    write_record,
)
from ep_image.backends.hybridep.proc_dirs import (
    BASE_ENV,
    JIT_SUBDIR,
    MARKER,
    clean_stale,
    jit_base,
    jit_dir,
    marker_for,
    read_marker,
    remove_tree,
    untrusted_chain,
)
from ep_image.files.trust import untrusted, untrusted_cache, untrusted_stat

CACHE_ENV = "EP_HYBRIDEP_JIT_CACHE"
DEFAULT_CACHE = "/var/cache/ep-jit/hybrid_ep"
OFF = frozenset({"", "0", "off", "no", "none", "false"})

_lock = threading.Lock()
_open: dict[tuple[int, str], JitCache] = {}
_warned: set[str] = set()


def _warn(message: str) -> None:
    """One warning per message and process: eight ranks need not repeat it eight times each step."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(f"HybridEP JIT cache: {message}", RuntimeWarning, stacklevel=3)


def cache_dir(env: Mapping[str, str]) -> tuple[str | None, str]:
    """The shared cache directory (None when disabled) and where that came from."""
    if CACHE_ENV not in env:
        return DEFAULT_CACHE, "default"
    value = env[CACHE_ENV].strip()
    return (None if value.lower() in OFF else value), CACHE_ENV


@dataclass
class JitCache:
    """One process's use of the shared cache; ``facts()`` is its part of a JSON report.

    ``load_cached_kernels`` is what to pass to ``HybridEPBuffer``: True once this process's
    jit directory holds only complete kernels of this build (from the cache or compiled here).
    """

    jit_dir: Path
    cache_dir: str | None
    cache_from: str
    key: str | None = None
    key_dir: Path | None = None
    key_material: dict[str, Any] = field(default_factory=dict)
    load_cached_kernels: bool = False
    writable: bool = False
    reason: str = ""
    files_before: int = 0
    warm_started: list[str] = field(default_factory=list)
    published: list[str] = field(default_factory=list)
    stale_removed: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=lambda: {"prepare": 0.0, "publish": 0.0})
    pid: int = field(default_factory=os.getpid)
    owns_dir: bool = False
    counted: bool = False
    users: int = 1
    closed: bool = False
    ignored: int = 0
    #: HybridEP's own jit directory when it was refused (another user could plant a kernel
    #: there); ``jit_dir`` is then one made private to this process, under ``private_base``,
    #: which HYBRID_EP_CACHE_DIR points at until ``close()`` (``base_before`` its value before).
    refused_dir: str | None = None
    private_base: Path | None = None
    base_before: str | None = None

    @property
    def state(self) -> str:
        """``on``, ``read-only`` (kernels loaded, new ones not kept) or ``off``."""
        if self.key_dir is None:
            return "off"
        return "on" if self.writable else "read-only"

    def warm_start(self) -> list[str]:
        """Place every valid cached kernel this directory lacks; return their names."""
        placed: list[str] = []
        if self.key_dir is None or not self.key_dir.is_dir():
            return placed
        have = {e.name for e in kernels(self.jit_dir)}
        cached = list(kernels(self.key_dir))
        if not self.counted:
            self.files_before, self.counted = len(cached), True
        foreign = 0
        for entry in cached:
            if entry.name in have:
                continue
            recorded = published_sha(self.key_dir, entry.name)
            if recorded is None:
                foreign += 1  # not published by this cache: never loaded
                continue
            outcome = self._place_published(Path(entry.path), entry.name, recorded)
            if outcome == "placed":
                placed.append(entry.name)
            elif outcome == "foreign":
                foreign += 1
        self.warm_started.extend(placed)
        self.ignored = foreign
        if foreign:
            _warn(
                f"{foreign} kernel(s) in {self.key_dir} were not published by this cache (no "
                "record of their sha256, or not this user's or root's): not loaded"
            )
        return placed

    def _place_published(self, src: Path, name: str, recorded: str) -> str:
        """Link (else copy) the cached kernel ``src`` into this process's directory if it is
        whole, trusted and the bytes its record names: "placed", "foreign" (not this user's or
        root's, or not a regular file), "damaged" or "skipped" (gone, or there already).

        The file is opened once and checked, hashed and linked (or copied) through that one
        descriptor: checked by path and then linked by path, a file swapped in between would
        be placed unchecked.
        """
        assert self.key_dir is not None
        try:
            fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return "skipped"  # gone meanwhile, or a symbolic link (ELOOP): never followed
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or untrusted_stat(src, st) is not None:
                return "foreign"
            if not valid_kernel_fd(fd) or sha256_fd(fd) != recorded:
                # Published whole, and now not what was published: damaged. Drop it (if the
                # name still holds that file) so the next publisher can replace it.
                with contextlib.suppress(OSError):
                    if os.lstat(src).st_ino == st.st_ino:
                        os.unlink(src)
                _warn(f"removed a damaged kernel from the cache: {src}")
                return "damaged"
            target = self.jit_dir / name
            try:
                # The open file itself, through /proc: same filesystem, no copy.
                os.link(f"/proc/self/fd/{fd}", target, follow_symlinks=True)
                return "placed"
            except FileExistsError:
                return "skipped"
            except OSError:
                # No hard link (another filesystem, a protected link, or the file was
                # replaced and is gone from the cache): copy the bytes that were checked.
                return "placed" if place(fd, self.jit_dir, name, durable=False,
                                         expect=recorded) else "skipped"  # fmt: skip
        finally:
            os.close(fd)

    def publish(self) -> list[str]:
        """Copy the kernels this process compiled into the shared cache; return their names.

        Call it after the first dispatch and combine (and backward) have run; ``close()``
        calls it once more. Never raises.
        """
        if self.closed or os.getpid() != self.pid or not self.writable or self.key_dir is None:
            return []
        started = time.monotonic()
        new: list[str] = []
        try:
            with _lock:
                cached = {
                    e.name for e in kernels(self.key_dir) if published_sha(self.key_dir, e.name)
                }
                for entry in kernels(self.jit_dir):
                    if entry.name in cached or not valid_kernel(Path(entry.path)):
                        continue
                    src = Path(entry.path)
                    if self._unrecorded(entry.name, src):
                        continue
                    if place(src, self.key_dir, entry.name, durable=True, record=True):
                        new.append(entry.name)
                with contextlib.suppress(OSError):
                    dir_fd = os.open(self.key_dir, os.O_RDONLY)
                    try:
                        os.fsync(dir_fd)
                    finally:
                        os.close(dir_fd)
        except OSError as exc:
            _warn(f"cannot publish to {self.key_dir} ({exc}): new kernels are not kept")
        self.published.extend(new)
        self.seconds["publish"] = round(self.seconds["publish"] + time.monotonic() - started, 6)
        return new

    def _unrecorded(self, name: str, src: Path) -> bool:
        """A kernel of this name is in the cache without its record: another rank is between
        placing it and recording it (True: leave it to that rank), or one left it there long
        ago (before records, or killed in between): then it is recorded here when its bytes
        are this process's, else removed so that this process places its own (False)."""
        assert self.key_dir is not None
        there = self.key_dir / name
        try:
            age = time.time() - os.lstat(there).st_mtime
        except FileNotFoundError:
            return False
        if age < TMP_MAX_AGE_S:
            return True
        if valid_kernel(there) and sha256(there) == sha256(src):
            mark_published(self.key_dir, name, sha256(there))
            return True
        with contextlib.suppress(FileNotFoundError):
            os.unlink(there)
        return False

    def close(self, publish: bool = True) -> None:
        """Publish (unless told not to) and remove this process's jit directory, once the
        last user in this process closes. A forked child never touches its parent's."""
        if self.closed or os.getpid() != self.pid:
            return
        with _lock:
            self.users -= 1
            last = self.users <= 0
        if publish:
            self.publish()
        if not last:
            return
        self.closed = True
        with _lock:
            for key in [key for key, cache in _open.items() if cache is self]:
                del _open[key]
        if self.owns_dir:
            remove_tree(self.jit_dir)
        if self.private_base is not None:
            shutil.rmtree(self.private_base, ignore_errors=True)
            if os.environ.get(BASE_ENV) == str(self.private_base):
                if self.base_before is None:
                    os.environ.pop(BASE_ENV, None)
                else:
                    os.environ[BASE_ENV] = self.base_before

    def close_at_exit(self) -> None:
        """The process ends: publish and remove, however many users are still open."""
        self.users = 1
        self.close()

    def facts(self) -> dict[str, Any]:
        """The report's view: where, which key, what was there, what this process added."""
        return {
            "jit_cache_dir": self.cache_dir,
            "jit_cache_from": self.cache_from,
            "jit_cache_state": self.state,
            "jit_cache_reason": self.reason,
            "jit_cache_key": self.key,
            "jit_cache_key_material": self.key_material,
            "jit_dir": str(self.jit_dir),
            "jit_dir_refused": self.refused_dir,
            "load_cached_kernels": self.load_cached_kernels,
            "jit_cache_files_before": self.files_before,
            "jit_cache_warm_started": len(self.warm_started),
            "jit_cache_ignored_unpublished": self.ignored,
            "jit_cache_published": sorted(self.published),
            "jit_cache_stale_removed": len(self.stale_removed),
            "jit_cache_seconds": dict(self.seconds),
        }


def prepare(
    env: Mapping[str, str] | None = None,
    *,
    arch: str | tuple[int, int] | None = None,
    package_dir: str | Path | None = None,
    at_exit: bool = True,
) -> JitCache:
    """Ready this process's HybridEP jit directory before a ``HybridEPBuffer`` is built.

    Removes stale proc-<pid> directories, empties a leftover one of this pid, and links in
    the cached kernels of this build. Pass ``arch`` (``torch.cuda.get_device_capability()``)
    and ``package_dir`` (``os.path.dirname(deep_ep.__file__)``) when at hand; without them
    nvidia-smi and ``importlib`` find them. A second call in the same process returns the
    same object (several buffers, one directory). Never raises: a cache that cannot be used
    gives ``load_cached_kernels=False`` and one warning.
    """
    env = dict(os.environ if env is None else env)
    directory = jit_dir(env)
    with _lock:
        existing = _open.get((os.getpid(), str(directory)))
        if existing is not None and not existing.closed:
            existing.users += 1
    if existing is not None and not existing.closed:
        with contextlib.suppress(OSError):
            existing.warm_start()
        return existing

    started = time.monotonic()
    root, source = cache_dir(env)
    cache = JitCache(jit_dir=directory, cache_dir=root, cache_from=source)
    try:
        _prepare(cache, env, arch, package_dir)
    except Exception as exc:  # a cache must never take the job down with it
        cache.key_dir, cache.writable, cache.load_cached_kernels = None, False, False
        cache.reason = str(exc) if isinstance(exc, CacheOff) else f"{type(exc).__name__}: {exc}"
        if cache.refused_dir is not None:  # the reason says where it compiles instead
            _warn(cache.reason)
        elif root is not None:
            _warn(f"{cache.reason}; HybridEP compiles its kernels in this process")
    cache.seconds["prepare"] = round(time.monotonic() - started, 6)
    with _lock:
        # Under the directory asked for and the one used (a private one after a refusal,
        # which a later prepare() finds through HYBRID_EP_CACHE_DIR).
        _open[(cache.pid, str(directory))] = cache
        _open[(cache.pid, str(cache.jit_dir))] = cache
    if at_exit:
        atexit.register(cache.close_at_exit)
    return cache


_TRUST_FIX = (
    f"Fix: chown/chmod go-w it, or set {CACHE_ENV} to a directory only you (or root) can write"
)


def _refuse_foreign(root: Path) -> None:
    """CacheOff when the cache directory, or the one holding it, lets another user plant or
    swap kernels (a sticky directory such as /tmp may hold it)."""
    if (why := untrusted_cache(root)) is not None:
        raise CacheOff(f"{why}: its kernels could be anyone's. {_TRUST_FIX}")


def _make_own(base: Path, directory: Path, pid: int) -> str | None:
    """Make ``directory`` (HybridEP's proc-<pid> under ``base``) this process's, empty but for
    its marker; or say why it cannot be trusted to hold only this process's kernels.

    HybridEP loads from it: it must be this user's (or root's) and nobody else's to write, and
    so must every directory above it up to ``base``'s parent (or sticky, for those holding the
    next): anyone who can rename one of them can put their own tree, kernel included, in its
    place. It must hold nothing left there by someone else (a directory another user made
    first, in a shared HYBRID_EP_CACHE_DIR, cannot be removed here).
    """
    mine = marker_for(pid)
    if read_marker(directory) != mine and directory.exists():
        remove_tree(directory)
    directory.mkdir(parents=True, exist_ok=True)
    why = untrusted_chain(base, directory)
    left = sorted(set(os.listdir(directory)) - {MARKER}) if why is None else []
    if why is None and left:
        why = f"{directory} still holds {left[0]} (and {len(left) - 1} more), not this process's"
    if why is None:
        (directory / MARKER).write_text(json.dumps(mine) + "\n")
    return why


def _go_private(cache: JitCache) -> Path | None:
    """Point HybridEP (HYBRID_EP_CACHE_DIR, read when a HybridEPBuffer is built) at a new
    directory only this process's user can write, and make its proc-<pid> there; return that,
    or None when no temporary directory gives a trusted one. ``close()`` undoes it."""
    for where in dict.fromkeys([tempfile.gettempdir(), "/tmp"]):
        try:
            base = Path(tempfile.mkdtemp(prefix="ep-hybridep-jit-", dir=where))
        except OSError:
            continue
        directory = base
        try:
            for part in (*JIT_SUBDIR.parts, f"proc-{cache.pid}"):
                directory = directory / part
                os.mkdir(directory, 0o700)  # not os.makedirs: its parents ignore the mode
            why = untrusted_chain(base, directory)
            if why is None:
                (directory / MARKER).write_text(json.dumps(marker_for(cache.pid)) + "\n")
        except OSError as exc:
            why = str(exc)
        if why is not None:
            shutil.rmtree(base, ignore_errors=True)
            continue
        cache.base_before = os.environ.get(BASE_ENV)
        os.environ[BASE_ENV] = str(base)
        cache.private_base, cache.jit_dir, cache.owns_dir = base, directory, True
        return directory
    return None


def _prepare(
    cache: JitCache,
    env: Mapping[str, str],
    arch: str | tuple[int, int] | None,
    package_dir: str | Path | None,
) -> None:
    # This process's directory first: whatever happens to the shared cache, it must not hold
    # kernels a dead process with the same pid left (containers reuse small pids).
    directory = cache.jit_dir
    why = _make_own(jit_base(env), directory, cache.pid)
    if why is not None:
        cache.refused_dir = str(directory)
        private = _go_private(cache)
        instead = (
            f"HybridEP compiles in {private} instead, a directory of this process's own"
            if private is not None
            else "no private directory could be made (TMPDIR, /tmp): HybridEP compiles there"
        )
        raise CacheOff(
            f"HybridEP's own jit directory {directory} is not safe to load kernels from: "
            f"{why}; {instead}. Fix: set {BASE_ENV} to a directory only you (or root) can "
            "write, whose parent others cannot write or is sticky (as /tmp)"
        )
    cache.owns_dir = True
    cache.stale_removed = clean_stale(directory.parent)

    if cache.cache_dir is None:
        cache.reason = f"disabled ({CACHE_ENV}={env.get(CACHE_ENV, '')!r})"
        return
    package, extension = find_package(package_dir)
    cuda_home = env.get("CUDA_HOME", "")
    if not cuda_home:
        raise CacheOff("CUDA_HOME is not set (HybridEP runs $CUDA_HOME/bin/nvcc)")
    label = arch_label(arch, env)
    cache.key, cache.key_material = cache_key(
        package, extension, Path(cuda_home) / "bin" / "nvcc", label, env
    )
    key_dir = Path(cache.cache_dir) / cache.key
    _refuse_foreign(Path(cache.cache_dir))
    try:
        key_dir.mkdir(parents=True, exist_ok=True)
        if (why := untrusted(key_dir)) is not None:
            raise CacheOff(f"{why}: its kernels could be anyone's. {_TRUST_FIX}")
        if not os.access(key_dir, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "not writable")
        write_record(key_dir, KEY_RECORD, {**cache.key_material, "extension": str(extension)})
        clean_temps(key_dir, time.time())
        cache.writable = True
    except OSError as exc:
        if not key_dir.is_dir():
            raise CacheOff(
                f"cannot create {key_dir} ({exc.strerror or exc}): set {CACHE_ENV} to a "
                "writable directory, or to off"
            ) from None
        cache.reason = f"{key_dir} is read-only here ({exc.strerror or exc})"
        _warn(f"{cache.reason}: cached kernels are used, new ones are not kept")
    cache.key_dir = key_dir
    cache.warm_start()
    cache.load_cached_kernels = True
