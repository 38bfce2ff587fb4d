"""HybridEP's JIT kernels kept across processes: a shared cache keyed on what they are built from.

HybridEP compiles its kernels with nvcc in every process; ``prepare()`` fills its per-process
directory from ``$EP_HYBRIDEP_JIT_CACHE``, ``publish()`` adds what it compiled. Nothing here may
fail a training job: every problem becomes one warning. Standard library only: the probes load
it inside backend venvs. See docs/image.md, section "Running the image".
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import hashlib
import importlib.util
import json
import os
import pwd
import re
import secrets
import shutil
import socket
import struct
import subprocess
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CACHE_ENV = "EP_HYBRIDEP_JIT_CACHE"
DEFAULT_CACHE = "/var/cache/ep-jit/hybrid_ep"
OFF = frozenset({"", "0", "off", "no", "none", "false"})
#: This module's record in a proc-<pid> directory: whose it is, so a later process can tell a
#: dead owner from a live one. Not a ``.so``: HybridEP loads only those.
MARKER = ".ep-image-owner.json"
#: What a key directory's hash was made of, for people reading the cache.
KEY_RECORD = "key.json"
#: A publisher's temporary file older than this was abandoned (a copy takes milliseconds).
TMP_MAX_AGE_S = 3600.0
#: A proc-<pid> directory this module cannot prove dead (no marker, or written on another host
#: or in another pid namespace: a shared home) is removed only when unchanged this long.
UNPROVEN_MAX_AGE_S = 7 * 86400.0
KEY_SCHEMA = 1

_PROC_DIR = re.compile(r"proc-(\d+)")
# HybridEP's kernel keys are get_key()'s values joined by '-' (numbers, 0/1, uint8_t/uint16_t);
# the file nvcc writes first is "<key>-rank-<r>-node-<n>-<ns>-<comm_id>.so", renamed to
# "<key>.so" only after dlopen succeeded: only the renamed ones are complete kernels.
_KERNEL = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]*\.so")
_ET_DYN, _PT_LOAD = 3, 1
_CHUNK = 1 << 20

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


def jit_root(env: Mapping[str, str]) -> Path:
    """HybridEP's jit directory without the proc-<pid> part, found as its get_jit_dir() does
    (HYBRID_EP_CACHE_DIR, else the passwd entry's home, not $HOME, else /tmp)."""
    base = env.get("HYBRID_EP_CACHE_DIR", "")
    if not base:
        try:
            base = pwd.getpwuid(os.getuid()).pw_dir
        except KeyError:
            base = ""
    return Path(base or "/tmp") / ".deepep" / "hybrid_ep" / "jit"


def jit_dir(env: Mapping[str, str], pid: int | None = None) -> Path:
    """This process's (or ``pid``'s) directory HybridEP compiles into and loads from."""
    return jit_root(env) / f"proc-{os.getpid() if pid is None else pid}"


def is_kernel_name(name: str) -> bool:
    """A kernel HybridEP finished and renamed to its key, not nvcc's output in progress."""
    return bool(_KERNEL.fullmatch(name)) and "-rank-" not in name


def valid_kernel(path: Path) -> bool:
    """A complete 64-bit ELF shared object: every loaded segment and the section header
    table lie inside the file, so a truncated copy is refused before dlopen sees it."""
    try:
        with path.open("rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(64)
            if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
                return False
            (e_type,) = struct.unpack_from("<H", head, 16)
            phoff, shoff = struct.unpack_from("<QQ", head, 0x20)
            phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", head, 0x36)
            if e_type != _ET_DYN or phnum == 0 or phentsize < 56:
                return False
            if phoff + phnum * phentsize > size or shoff + shnum * shentsize > size:
                return False
            fh.seek(phoff)
            table = fh.read(phnum * phentsize)
        for i in range(phnum):
            p_type, _flags, p_offset, _vaddr, _paddr, p_filesz = struct.unpack_from(
                "<IIQQQQ", table, i * phentsize
            )
            if p_type == _PT_LOAD and p_offset + p_filesz > size:
                return False
    except (OSError, struct.error):
        return False
    return True


def arch_label(arch: str | tuple[int, int] | None, env: Mapping[str, str]) -> str:
    """``sm90`` from (9, 0), "9.0", "sm_90"; without one, the visible GPUs' compute
    capabilities from nvidia-smi; ``unknown`` when neither says."""
    if arch is None:
        arch = "+".join(_smi_capabilities(env)) or "unknown"
    if isinstance(arch, tuple):
        return f"sm{arch[0]}{arch[1]}"
    text = arch.strip().lower()
    parts = [_one_arch(part) for part in text.split("+")]
    return "+".join(parts)


def _one_arch(text: str) -> str:
    match = re.fullmatch(r"(?:sm_?)?(\d+)\.?(\d)([a-z]?)", text)
    if match:
        return f"sm{match[1]}{match[2]}{match[3]}"
    return re.sub(r"[^a-z0-9_.]", "_", text) or "unknown"


def _smi_capabilities(env: Mapping[str, str]) -> list[str]:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            env=dict(env),
        )
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode != 0:
        return []
    return sorted({line.strip() for line in out.stdout.splitlines() if line.strip()})


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _tree_digest(root: Path) -> str:
    """Names and bytes of every file under ``root`` (HybridEP's -I directory)."""
    digest = hashlib.sha256()
    files = sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    if not files:
        raise _Off(f"{root} holds no files: not an installed HybridEP")
    for path in files:
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(_file_digest(path).encode() + b"\0")
    return digest.hexdigest()


def _nvcc_version(nvcc: Path, env: Mapping[str, str]) -> str:
    try:
        out = subprocess.run(
            [str(nvcc), "--version"], capture_output=True, text=True, timeout=120, env=dict(env)
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise _Off(f"{nvcc} --version failed ({exc}): HybridEP cannot compile either") from None
    if out.returncode != 0 or not out.stdout.strip():
        raise _Off(f"{nvcc} --version exited {out.returncode}: HybridEP cannot compile either")
    return out.stdout.strip()


def find_package(package_dir: str | Path | None) -> tuple[Path, Path]:
    """The installed ``deep_ep`` directory (HybridEP's base_path) and its ``hybrid_ep_cpp``
    extension, found without importing either."""
    if package_dir is None:
        spec = importlib.util.find_spec("deep_ep")
        if spec is None or not spec.submodule_search_locations:
            raise _Off("deep_ep is not installed here")
        package_dir = next(iter(spec.submodule_search_locations))
    package = Path(package_dir)
    candidates = sorted(package.parent.glob("hybrid_ep_cpp*.so"))
    if not candidates:
        spec = importlib.util.find_spec("hybrid_ep_cpp")
        if spec is not None and spec.origin:
            candidates = [Path(spec.origin)]
    if not candidates:
        raise _Off(f"no hybrid_ep_cpp extension beside {package}: not a HybridEP build")
    return package, candidates[0]


def cache_key(
    package: Path, extension: Path, nvcc: Path, arch: str, env: Mapping[str, str]
) -> tuple[str, dict[str, Any]]:
    """The key directory's name and what it was hashed from: everything that changes the
    bytes nvcc writes for the same kernel key."""
    material = {
        "schema": KEY_SCHEMA,
        "backend_headers_sha256": _tree_digest(package / "backend"),
        "hybrid_ep_cpp_sha256": _file_digest(extension),
        "nvcc_version": _nvcc_version(nvcc, env),
        "arch": arch,
        # Read by HybridEP's inter-node JIT when built with NIXL.
        "nixl_home": env.get("NIXL_HOME", ""),
        "ucx_home": env.get("UCX_HOME", ""),
    }
    digest = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()
    return f"{arch}-{digest[:24]}", material


class _Off(Exception):
    """The cache cannot be used here; the message says why (and goes into the report)."""


# ---- processes --------------------------------------------------------------------------------


def _host_id() -> str | None:
    """This kernel boot and pid namespace: pids are only comparable within one."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (None when it does not exist or
    is a zombie): a pid reused by a later process has another."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    if not fields or fields[0] in ("Z", "X"):
        return None
    return fields[19] if len(fields) > 19 else None


def _marker_for(pid: int) -> dict[str, Any]:
    return {
        "pid": pid,
        "start": _start_time(pid),
        "host": _host_id(),
        "hostname": socket.gethostname(),
    }


def _read_marker(directory: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _newest_mtime(directory: Path) -> float:
    newest = directory.stat().st_mtime
    for entry in os.scandir(directory):
        with contextlib.suppress(OSError):
            newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
    return newest


def _is_stale(directory: Path, pid: int, now: float) -> bool:
    """Dead for sure (our marker, this host, the pid gone or reused), or unproven and old."""
    marker = _read_marker(directory)
    host = _host_id()
    if marker and host and marker.get("host") == host and marker.get("pid") == pid:
        start = _start_time(pid)
        return start is None or start != marker.get("start")
    if _start_time(pid) is not None:
        return False  # something with that pid runs here: keep what might be its directory
    return now - _newest_mtime(directory) > UNPROVEN_MAX_AGE_S


def _remove_tree(directory: Path) -> bool:
    """Claim by rename (two cleaners never fight over one tree), then delete."""
    claimed = directory.with_name(f".removing-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        os.rename(directory, claimed)
    except OSError:
        return False
    shutil.rmtree(claimed, ignore_errors=True)
    return True


def clean_stale(root: Path, now: float | None = None) -> list[str]:
    """Remove this user's proc-<pid> directories whose process is gone; return their names."""
    now = time.time() if now is None else now
    removed: list[str] = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    me, uid = os.getpid(), os.getuid()
    for entry in entries:
        if entry.name.startswith(".removing-"):
            # A cleaner that died between its rename and its rmtree.
            with contextlib.suppress(OSError):
                if now - entry.stat(follow_symlinks=False).st_mtime > TMP_MAX_AGE_S:
                    shutil.rmtree(entry.path, ignore_errors=True)
            continue
        match = _PROC_DIR.fullmatch(entry.name)
        if not match or int(match[1]) == me:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if not entry.is_dir(follow_symlinks=False) or st.st_uid != uid:
                continue
            stale = _is_stale(Path(entry.path), int(match[1]), now)
        except OSError:
            continue
        if stale and _remove_tree(Path(entry.path)):
            removed.append(entry.name)
    return removed


# ---- files ------------------------------------------------------------------------------------


def _copy_bytes(src: Path, fd: int) -> None:
    with src.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view) :]


def _temp_name(name: str) -> str:
    # Never ends in .so: HybridEP loads every .so in its directory, and a warm start every
    # .so in the cache.
    return f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def _place(src: Path, directory: Path, name: str, *, durable: bool) -> bool:
    """Put a copy of ``src`` at ``directory/name`` so that nobody ever sees it half written:
    a temporary file in the same directory, checked, then linked (or renamed) into place.
    False when ``name`` was there already (another rank won) or the copy was not complete."""
    tmp = directory / _temp_name(name)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        try:
            _copy_bytes(src, fd)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        if not valid_kernel(tmp):
            return False
        try:
            os.link(tmp, directory / name)
        except FileExistsError:
            return False
        except OSError:
            # A filesystem without hard links: rename replaces atomically; both are whole.
            os.rename(tmp, directory / name)
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _kernels(directory: Path) -> Iterator[os.DirEntry[str]]:
    for entry in os.scandir(directory):
        if is_kernel_name(entry.name) and entry.is_file(follow_symlinks=False):
            yield entry


def _clean_temps(directory: Path, now: float) -> None:
    for entry in os.scandir(directory):
        if entry.name.startswith(".") and entry.name.endswith(".tmp"):
            with contextlib.suppress(OSError):
                if now - entry.stat(follow_symlinks=False).st_mtime > TMP_MAX_AGE_S:
                    os.unlink(entry.path)


def _write_record(directory: Path, name: str, data: dict[str, Any]) -> None:
    if (directory / name).exists():
        return
    tmp = directory / _temp_name(name)
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    try:
        os.link(tmp, directory / name)
    except FileExistsError:
        pass
    finally:
        tmp.unlink()


# ---- the API ----------------------------------------------------------------------------------


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
        have = {e.name for e in _kernels(self.jit_dir)}
        cached = list(_kernels(self.key_dir))
        if not self.counted:
            self.files_before, self.counted = len(cached), True
        for entry in cached:
            if entry.name in have:
                continue
            src = Path(entry.path)
            if not valid_kernel(src):
                # Every name in the cache was published whole: this one is damaged. Drop it so
                # the next publisher can replace it.
                with contextlib.suppress(OSError):
                    os.unlink(src)
                _warn(f"removed a damaged kernel from the cache: {src}")
                continue
            try:
                os.link(src, self.jit_dir / entry.name)  # same filesystem: no copy
                placed.append(entry.name)
            except FileExistsError:
                continue
            except OSError:
                if _place(src, self.jit_dir, entry.name, durable=False):
                    placed.append(entry.name)
        self.warm_started.extend(placed)
        return placed

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
                cached = {e.name for e in _kernels(self.key_dir)}
                for entry in _kernels(self.jit_dir):
                    if entry.name in cached or not valid_kernel(Path(entry.path)):
                        continue
                    if _place(Path(entry.path), self.key_dir, entry.name, durable=True):
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
            _open.pop((self.pid, str(self.jit_dir)), None)
        if self.owns_dir:
            _remove_tree(self.jit_dir)

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
            "load_cached_kernels": self.load_cached_kernels,
            "jit_cache_files_before": self.files_before,
            "jit_cache_warm_started": len(self.warm_started),
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
        cache.reason = str(exc) if isinstance(exc, _Off) else f"{type(exc).__name__}: {exc}"
        if root is not None:
            _warn(f"{cache.reason}; HybridEP compiles its kernels in this process")
    cache.seconds["prepare"] = round(time.monotonic() - started, 6)
    with _lock:
        _open[(cache.pid, str(directory))] = cache
    if at_exit:
        atexit.register(cache.close_at_exit)
    return cache


def _prepare(
    cache: JitCache,
    env: Mapping[str, str],
    arch: str | tuple[int, int] | None,
    package_dir: str | Path | None,
) -> None:
    # This process's directory first: whatever happens to the shared cache, it must not hold
    # kernels a dead process with the same pid left (containers reuse small pids).
    directory = cache.jit_dir
    mine = _marker_for(cache.pid)
    if _read_marker(directory) != mine and directory.exists():
        _remove_tree(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MARKER).write_text(json.dumps(mine) + "\n")
    cache.owns_dir = True
    cache.stale_removed = clean_stale(directory.parent)

    if cache.cache_dir is None:
        cache.reason = f"disabled ({CACHE_ENV}={env.get(CACHE_ENV, '')!r})"
        return
    package, extension = find_package(package_dir)
    cuda_home = env.get("CUDA_HOME", "")
    if not cuda_home:
        raise _Off("CUDA_HOME is not set (HybridEP runs $CUDA_HOME/bin/nvcc)")
    label = arch_label(arch, env)
    cache.key, cache.key_material = cache_key(
        package, extension, Path(cuda_home) / "bin" / "nvcc", label, env
    )
    key_dir = Path(cache.cache_dir) / cache.key
    try:
        key_dir.mkdir(parents=True, exist_ok=True)
        if not os.access(key_dir, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "not writable")
        _write_record(key_dir, KEY_RECORD, {**cache.key_material, "extension": str(extension)})
        _clean_temps(key_dir, time.time())
        cache.writable = True
    except OSError as exc:
        if not key_dir.is_dir():
            raise _Off(
                f"cannot create {key_dir} ({exc.strerror or exc}): set {CACHE_ENV} to a "
                "writable directory, or to off"
            ) from None
        cache.reason = f"{key_dir} is read-only here ({exc.strerror or exc})"
        _warn(f"{cache.reason}: cached kernels are used, new ones are not kept")
    cache.key_dir = key_dir
    cache.warm_start()
    cache.load_cached_kernels = True
