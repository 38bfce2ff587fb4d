"""HybridEP's per-process jit directories (``.../.deepep/hybrid_ep/jit/proc-<pid>``): where they
are, whose they are, and removing those whose process is gone.

Why a module of its own: HybridEP compiles into ``proc-<pid>`` and never removes it, and a
container that reuses a small pid would load a dead process's kernels (of whatever build) from
it. A marker written by this package records which process a directory belongs to, so that a
directory is removed only when its process is provably gone (or, unproven, long unchanged).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import secrets
import shutil
import socket
import stat
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ep_image.backends.hybridep.kernel_files import TMP_MAX_AGE_S
from ep_image.files.trust import untrusted_stat

#: This package's record in a proc-<pid> directory: whose it is, so a later process can tell a
#: dead owner from a live one. Not a ``.so``: HybridEP loads only those.
MARKER = ".ep-image-owner.json"
#: A proc-<pid> directory this package cannot prove dead (no marker, or written on another host
#: or in another pid namespace: a shared home) is removed only when unchanged this long.
UNPROVEN_MAX_AGE_S = 7 * 86400.0

_PROC_DIR = re.compile(r"proc-(\d+)")


#: The variable HybridEP's get_jit_dir() reads, at each HybridEPBuffer's construction.
BASE_ENV = "HYBRID_EP_CACHE_DIR"
#: What HybridEP puts between its base directory and the proc-<pid> directories.
JIT_SUBDIR = Path(".deepep") / "hybrid_ep" / "jit"


def jit_base(env: Mapping[str, str]) -> Path:
    """The directory HybridEP's get_jit_dir() starts from: HYBRID_EP_CACHE_DIR, else the
    passwd entry's home (not $HOME), else /tmp."""
    base = env.get(BASE_ENV, "")
    if not base:
        try:
            base = pwd.getpwuid(os.getuid()).pw_dir
        except KeyError:
            base = ""
    return Path(base or "/tmp")


def jit_root(env: Mapping[str, str]) -> Path:
    """HybridEP's jit directory without the proc-<pid> part, found as its get_jit_dir() does."""
    return jit_base(env) / JIT_SUBDIR


def untrusted_chain(base: Path, directory: Path) -> str | None:
    """Why HybridEP's ``directory`` (under ``base``) may hold kernels that are not this user's
    or root's, or None. Every directory from ``base``'s parent down to ``directory`` must be
    this user's or root's (an owner can rename what is inside, sticky or not), and each one
    holding the next writable by nobody else unless sticky (else another user renames the
    next one aside and builds their own, kernel included, in its place); ``directory`` itself
    writable by nobody else. ``base`` and its parent are followed if symbolic links (as
    ep_image.files.trust.untrusted_cache does), the directories below them must not be links."""
    below = directory.relative_to(base).parts
    chain: list[tuple[Path, bool]] = []
    if base.parent != base:
        chain.append((base.parent, True))
    chain.append((base, True))
    path = base
    for part in below:
        path = path / part
        chain.append((path, False))
    last = len(chain) - 1
    for i, (path, follow) in enumerate(chain):
        try:
            st = os.stat(path) if follow else os.lstat(path)
        except OSError as exc:
            return f"{path} cannot be looked at ({exc.strerror or exc})"
        why = untrusted_stat(path, st)
        if why is None:
            continue
        holds_next = i < last and stat.S_ISDIR(st.st_mode)
        if holds_next and st.st_mode & stat.S_ISVTX and why.startswith("others can write"):
            continue  # sticky, and this user's or root's: what is ours in it stays ours
        return why
    return None


def jit_dir(env: Mapping[str, str], pid: int | None = None) -> Path:
    """This process's (or ``pid``'s) directory HybridEP compiles into and loads from."""
    return jit_root(env) / f"proc-{os.getpid() if pid is None else pid}"


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
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()
    if not fields or fields[0] in ("Z", "X"):
        return None
    return fields[19] if len(fields) > 19 else None


def marker_for(pid: int) -> dict[str, Any]:
    """What MARKER says of the process ``pid``: enough to tell it from a later one."""
    return {
        "pid": pid,
        "start": _start_time(pid),
        "host": _host_id(),
        "hostname": socket.gethostname(),
    }


def read_marker(directory: Path) -> dict[str, Any] | None:
    """The MARKER of ``directory`` (None when it has none, or an unreadable one)."""
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
    marker = read_marker(directory)
    host = _host_id()
    if marker and host and marker.get("host") == host and marker.get("pid") == pid:
        start = _start_time(pid)
        return start is None or start != marker.get("start")
    if _start_time(pid) is not None:
        return False  # something with that pid runs here: keep what might be its directory
    return now - _newest_mtime(directory) > UNPROVEN_MAX_AGE_S


def remove_tree(directory: Path) -> bool:
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
        if stale and remove_tree(Path(entry.path)):
            removed.append(entry.name)
    return removed
