"""ep_image/backends/hybridep/jit_cache.py (and its modules) on real files and real processes.

Why these tests: the cache's promises are about processes that run at the same time, die
half-way or come from another build: ranks that publish together, a third that starts warm, a
publisher killed mid-copy, a key that must not match, a cache it cannot write, proc-<pid>
directories of dead and live processes. Each is set up here for real (subprocesses that
prepare, "compile" the way HybridEP does and publish) and judged on the files left behind.
A fake HybridEP install stands in for the real one: deep_ep/backend headers, a hybrid_ep_cpp
extension file and an nvcc that prints a version.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pwd
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, clean_env

from ep_image.backends.hybridep import cache_key, kernel_files, proc_dirs
from ep_image.backends.hybridep import jit_cache as jit

# The cache's warnings are what several tests check: each test that expects one catches and
# counts it; any other warning here is a defect, not noise in the run's summary.
pytestmark = pytest.mark.filterwarnings("error")

# A child that does what a rank does: prepare, list what HybridEPBuffer(load_cached_kernels=True)
# would load, compile (nvcc's output file, renamed to <key>.so after dlopen), publish, exit.
CHILD = r"""
import json, os, sys, time
from pathlib import Path
from ep_image.backends.hybridep import jit_cache as jit, kernel_files

cfg = json.loads(sys.argv[1])
if cfg.get("pause_copy"):
    def paused(src, fd):
        data = Path(src).read_bytes()
        os.write(fd, data[: len(data) // 2])
        Path(cfg["pause_copy"]).write_text("paused")
        time.sleep(120)
    kernel_files._copy_bytes = paused
cache = jit.prepare(arch=cfg.get("arch"), package_dir=cfg["package_dir"])
loaded = sorted(p.name for p in cache.jit_dir.iterdir() if p.suffix == ".so")
if cfg.get("barrier"):  # every rank has prepared before any compiles, as in one job
    where, ranks = Path(cfg["barrier"][0]), cfg["barrier"][1]
    (where / str(os.getpid())).write_text("")
    deadline = time.monotonic() + 60
    while len(list(where.iterdir())) < ranks and time.monotonic() < deadline:
        time.sleep(0.01)
for name, src in cfg.get("compile", {}).items():
    out = cache.jit_dir / f"{name}-rank-0-node-0-{time.monotonic_ns()}-c0ffee.so"
    out.write_bytes(Path(src).read_bytes())
    os.rename(out, cache.jit_dir / f"{name}.so")
published = cache.publish()
print(json.dumps({"pid": os.getpid(), "loaded": loaded, "published": published,
                  "facts": cache.facts()}), flush=True)
if cfg.get("hold"):
    Path(cfg["hold"]).write_text("ready")
    time.sleep(120)
if cfg.get("skip_exit_handlers"):
    os._exit(0)
"""

# Kernel keys as HybridEP's get_key() writes them (hidden, tokens, experts, ranks, nodes, ...).
K_PRE = "7168-4096-256-2-1-16-128-512-32-0-0"
K_DISPATCH = "7168-4096-256-2-1-uint16_t-10-2-6-2-16-2-128-32-16-1-0-0-0"
K_COMBINE = "7168-4096-256-2-1-8-8-4-4-128-32-32-16-2-2-0-0-0-0"


def elf_kernel(payload: bytes) -> bytes:
    """A minimal 64-bit ELF shared object: header, one PT_LOAD over the payload, and a
    section header table at the end, as nvcc's .so files have (a truncation loses it)."""
    loaded = 64 + 56 + len(payload)
    header = (
        b"\x7fELF\x02\x01\x01"
        + b"\0" * 9
        + struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 64, loaded, 0, 64, 56, 1, 64, 1, 0)
    )
    phdr = struct.pack("<IIQQQQQQ", 1, 5, 0, 0, 0, loaded, loaded, 0x1000)
    return header + phdr + payload + b"\0" * 64


@dataclass
class Install:
    """A fake HybridEP install and the environment a rank would run with."""

    package_dir: Path
    env: dict[str, str]
    cache: Path
    jit_root: Path

    def run(self, **cfg: Any) -> dict[str, Any]:
        """A child rank to the end; its JSON line."""
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps(self._cfg(cfg))],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def start(self, **cfg: Any) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-c", CHILD, json.dumps(self._cfg(cfg))],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def _cfg(self, cfg: dict[str, Any]) -> dict[str, Any]:
        cfg.setdefault("arch", "9.0")
        cfg["package_dir"] = str(self.package_dir)
        cfg["compile"] = {k: str(v) for k, v in cfg.get("compile", {}).items()}
        return cfg

    def prepare(self, **kwargs: Any) -> jit.JitCache:
        """In this process (the pytest process's own proc-<pid>); close it when done."""
        kwargs.setdefault("arch", "9.0")
        return jit.prepare(self.env, package_dir=self.package_dir, at_exit=False, **kwargs)

    def key_dir(self) -> Path:
        (only,) = [p for p in self.cache.iterdir() if p.is_dir()]
        return only


def make_install(
    base: Path,
    *,
    cache: Path,
    jit_home: Path,
    header: str = "template <int H> struct hybrid_ep {};\n",
    extension: bytes = b"hybrid_ep_cpp built with SM_ARCH=9.0",
    nvcc_release: str = "Cuda compilation tools, release 13.0, V13.0.88",
) -> Install:
    site = base / "site-packages"
    backend = site / "deep_ep" / "backend"
    backend.mkdir(parents=True)
    (backend / "hybrid_ep_backend.cuh").write_text(header)
    (backend / "utils.cuh").write_text("inline int get_key();\n")
    (site / "hybrid_ep_cpp.cpython-312-x86_64-linux-gnu.so").write_bytes(extension)
    nvcc = base / "cuda" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text(
        f"#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\necho '{nvcc_release}'\n"
    )
    nvcc.chmod(0o755)
    env = clean_env(
        PYTHONPATH=str(ROOT),
        CUDA_HOME=str(base / "cuda"),
        HYBRID_EP_CACHE_DIR=str(jit_home),
        EP_HYBRIDEP_JIT_CACHE=str(cache),
    )
    return Install(site / "deep_ep", env, cache, jit_home / ".deepep" / "hybrid_ep" / "jit")


@pytest.fixture
def install(tmp_path: Path) -> Install:
    return make_install(tmp_path / "install", cache=tmp_path / "cache", jit_home=tmp_path / "home")


@pytest.fixture
def kernels(tmp_path: Path) -> dict[str, Path]:
    """Kernel files (several MB, so a copy takes several chunks) by name, two versions of one."""
    out = {}
    for i, name in enumerate([K_PRE, K_DISPATCH, K_COMBINE, "combine-b"]):
        path = tmp_path / f"kernel{i}.bin"
        path.write_bytes(elf_kernel(bytes([i + 1]) * (3 << 20)))
        out[name] = path
    return out


def so_files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.suffix == ".so"}


def proc_dir_names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("proc-"))


# ---- what a rank sees ------------------------------------------------------------------------


def test_two_ranks_publish_and_a_third_starts_warm(
    install: Install, kernels: dict[str, Path], tmp_path: Path
):
    """Two ranks compile at the same time (one kernel each and one in common, with different
    bytes) and publish; a third loads all three before compiling anything."""
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    first = install.start(
        compile={K_PRE: kernels[K_PRE], K_COMBINE: kernels[K_COMBINE]}, barrier=[str(barrier), 2]
    )
    second = install.start(
        compile={K_DISPATCH: kernels[K_DISPATCH], K_COMBINE: kernels["combine-b"]},
        barrier=[str(barrier), 2],
    )
    results = []
    for proc in (first, second):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, out + err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["loaded"] == [] for r in results), "the cache was empty"
    assert {f"{K_PRE}.so", f"{K_DISPATCH}.so"} <= {n for r in results for n in r["published"]}
    assert sorted(n for r in results for n in r["published"]).count(f"{K_COMBINE}.so") == 1

    key_dir = install.key_dir()
    cached = so_files(key_dir)
    assert cached[f"{K_PRE}.so"] == kernels[K_PRE].read_bytes()
    assert cached[f"{K_DISPATCH}.so"] == kernels[K_DISPATCH].read_bytes()
    assert cached[f"{K_COMBINE}.so"] in (
        kernels[K_COMBINE].read_bytes(),
        kernels["combine-b"].read_bytes(),
    )
    kernel_names = {p.name for p in key_dir.iterdir() if p.suffix == ".so"}
    others = {p.name for p in key_dir.iterdir() if p.suffix != ".so"}
    assert others == {cache_key.KEY_RECORD} | {n + kernel_files.PUBLISHED for n in kernel_names}

    third = install.run()
    assert third["loaded"] == sorted(f"{k}.so" for k in (K_PRE, K_DISPATCH, K_COMBINE))
    facts = third["facts"]
    assert facts["load_cached_kernels"] is True
    assert facts["jit_cache_state"] == "on"
    assert facts["jit_cache_files_before"] == 3
    assert facts["jit_cache_warm_started"] == 3
    assert facts["jit_cache_published"] == []
    assert facts["jit_cache_key"] == key_dir.name
    assert json.loads((key_dir / cache_key.KEY_RECORD).read_text())["arch"] == "sm90"
    # Every rank removed its own proc-<pid> at exit.
    assert proc_dir_names(install.jit_root) == []


def test_a_killed_publisher_leaves_no_partial_kernel(
    install: Install, kernels: dict[str, Path], tmp_path: Path
):
    """SIGKILL in the middle of the copy into the cache: the kernel's name never appears, the
    half-written temporary file is not a .so, and later processes clean both it (once old)
    and the dead rank's proc-<pid>."""
    flag = tmp_path / "paused"
    proc = install.start(compile={K_DISPATCH: kernels[K_DISPATCH]}, pause_copy=str(flag))
    deadline = time.monotonic() + 60
    while not flag.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the publisher never reached its copy"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)

    key_dir = install.key_dir()
    temps = [p for p in key_dir.iterdir() if p.name.endswith(".tmp")]
    assert len(temps) == 1 and 0 < temps[0].stat().st_size < kernels[K_DISPATCH].stat().st_size
    assert so_files(key_dir) == {}
    assert proc_dir_names(install.jit_root) == [f"proc-{proc.pid}"]

    warm = install.run()
    assert warm["loaded"] == []
    assert warm["facts"]["jit_cache_files_before"] == 0
    assert warm["facts"]["jit_cache_stale_removed"] == 1
    assert proc_dir_names(install.jit_root) == []
    assert temps[0].exists(), "a young temporary file may be another publisher's, in progress"

    old = time.time() - kernel_files.TMP_MAX_AGE_S - 60
    os.utime(temps[0], (old, old))
    install.run()
    assert not temps[0].exists()


def test_another_build_nvcc_or_gpu_sees_none(tmp_path: Path, kernels: dict[str, Path]):
    """Same cache, same kernel names: any change to what nvcc builds from is another key."""
    shared = {"cache": tmp_path / "cache", "jit_home": tmp_path / "home"}
    base = make_install(tmp_path / "a", **shared)
    base.run(compile={K_PRE: kernels[K_PRE]})
    assert base.run()["loaded"] == [f"{K_PRE}.so"]  # the same build does see it

    others = {
        "headers": make_install(
            tmp_path / "b", header="template <int H, int N> struct x;\n", **shared
        ),
        "extension": make_install(
            tmp_path / "c", extension=b"hybrid_ep_cpp SM_ARCH=10.0", **shared
        ),
        "nvcc": make_install(
            tmp_path / "d", nvcc_release="Cuda compilation tools, release 13.1, V13.1.80", **shared
        ),
    }
    keys = {base.run()["facts"]["jit_cache_key"]}
    for what, other in others.items():
        result = other.run()
        assert result["loaded"] == [], what
        keys.add(result["facts"]["jit_cache_key"])
    gpu = base.run(arch="10.0")
    assert gpu["loaded"] == [] and gpu["facts"]["jit_cache_key"].startswith("sm100-")
    keys.add(gpu["facts"]["jit_cache_key"])
    assert len(keys) == 5


def test_files_hybridep_did_not_finish_are_never_published(
    install: Install, kernels: dict[str, Path]
):
    """nvcc's output before HybridEP's rename, a truncated kernel, a non-ELF file and a
    symlink stay out of the cache; the one finished kernel goes in."""
    cache = install.prepare()
    try:
        good = kernels[K_PRE].read_bytes()
        (cache.jit_dir / f"{K_DISPATCH}-rank-0-node-0-1234-c0ffee.so").write_bytes(good)
        (cache.jit_dir / f"{K_COMBINE}.so").write_bytes(good[: len(good) - 100])
        (cache.jit_dir / "9-9-9.so").write_bytes(b"not a kernel")
        (cache.jit_dir / "8-8-8.so").symlink_to(kernels[K_DISPATCH])
        (cache.jit_dir / f"{K_PRE}.so").write_bytes(good)
        assert cache.publish() == [f"{K_PRE}.so"]
        assert set(so_files(install.key_dir())) == {f"{K_PRE}.so"}
    finally:
        cache.close(publish=False)


def test_a_damaged_cached_kernel_is_not_loaded_and_is_dropped(
    install: Install, kernels: dict[str, Path]
):
    install.run(compile={K_PRE: kernels[K_PRE], K_COMBINE: kernels[K_COMBINE]})
    damaged = install.key_dir() / f"{K_COMBINE}.so"
    damaged.write_bytes(damaged.read_bytes()[:4096])
    result = install.run()
    assert result["loaded"] == [f"{K_PRE}.so"]
    assert not damaged.exists(), "the next publisher must be able to put it back"
    assert install.run(compile={K_COMBINE: kernels[K_COMBINE]})["published"] == [f"{K_COMBINE}.so"]


def test_valid_kernel_on_a_real_shared_object(tmp_path: Path):
    """The completeness check on a real .so (one of Python's own extensions), whole and cut."""
    origins = [importlib.util.find_spec(m) for m in ("_ctypes", "_decimal", "_json", "select")]
    shared = [Path(s.origin) for s in origins if s and s.origin and s.origin.endswith(".so")]
    if not shared:
        pytest.skip("this Python has its extension modules built in: no .so to read")
    real = shared[0]
    data = real.read_bytes()
    assert kernel_files.valid_kernel(real)
    for cut in (len(data) - 1, len(data) // 2, 100):
        part = tmp_path / f"cut{cut}.so"
        part.write_bytes(data[:cut])
        assert not kernel_files.valid_kernel(part), cut


# ---- kernels the cache did not publish -----------------------------------------------------


def test_a_planted_kernel_is_never_loaded(install: Install, kernels: dict[str, Path]):
    """Any valid ELF .so dropped under the key directory without this cache's record of its
    sha256 stays out of the process's jit directory (HybridEP would dlopen it), and so does
    one whose bytes were swapped after it was published."""
    install.run(compile={K_PRE: kernels[K_PRE]})
    key_dir = install.key_dir()
    planted = key_dir / f"{K_DISPATCH}.so"
    planted.write_bytes(kernels[K_DISPATCH].read_bytes())
    swapped = key_dir / f"{K_PRE}.so"
    swapped.unlink()
    swapped.write_bytes(kernels[K_COMBINE].read_bytes())  # a valid kernel, not the published one
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = install.prepare()
    try:
        assert so_files(cache.jit_dir) == {}, "a kernel it did not publish was placed"
        assert cache.facts()["jit_cache_ignored_unpublished"] == 1
        assert any("not published by this cache" in str(w.message) for w in caught)
        assert not swapped.exists(), "a published kernel whose bytes changed is dropped"
    finally:
        cache.close(publish=False)


@pytest.mark.parametrize("where", ["cache", "key directory"])
def test_a_cache_others_can_write_is_refused(
    install: Install, kernels: dict[str, Path], where: str
):
    """A cache directory (or key directory) anyone can write: whoever can write there could
    plant kernels and their records, so the cache is off with the fix named, and HybridEP
    compiles in this process as without a cache."""
    install.run(compile={K_PRE: kernels[K_PRE]})
    target = install.cache if where == "cache" else install.key_dir()
    target.chmod(0o777)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cache = install.prepare()
        try:
            assert cache.state == "off" and cache.load_cached_kernels is False
            assert so_files(cache.jit_dir) == {}
            assert "others can write" in cache.reason and "chmod go-w" in cache.reason
            assert len([w for w in caught if "HybridEP JIT cache" in str(w.message)]) == 1
        finally:
            cache.close(publish=False)
    finally:
        target.chmod(0o755)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving the cache to another user needs root")
def test_a_cache_another_user_owns_is_refused(install: Install, kernels: dict[str, Path]):
    install.run(compile={K_PRE: kernels[K_PRE]})
    os.chown(install.key_dir(), 65534, 65534)
    with pytest.warns(RuntimeWarning, match="HybridEP JIT cache: .* belongs to uid 65534"):
        cache = install.prepare()
    try:
        assert cache.state == "off" and "belongs to uid 65534" in cache.reason
        assert so_files(cache.jit_dir) == {}
    finally:
        cache.close(publish=False)


# ---- caches it cannot use --------------------------------------------------------------------


def test_a_cache_it_cannot_create_warns_once_and_compiles_as_before(
    install: Install, tmp_path: Path
):
    """The cache path runs through a regular file (no permission trick root could bypass)."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    install.env["EP_HYBRIDEP_JIT_CACHE"] = str(blocker / "hybrid_ep")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            cache = install.prepare()
            assert cache.load_cached_kernels is False
            assert cache.state == "off" and "cannot create" in cache.reason
            assert cache.publish() == []
            directory = cache.jit_dir
            assert directory.is_dir()
            cache.close()
            assert not directory.exists()
    assert len([w for w in caught if "HybridEP JIT cache" in str(w.message)]) == 1


def test_disabled_by_env(install: Install):
    install.env["EP_HYBRIDEP_JIT_CACHE"] = "off"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache = install.prepare()
    try:
        assert cache.state == "off" and cache.load_cached_kernels is False
        assert not install.cache.exists()
    finally:
        cache.close()


def _as_another_user(fn: Any) -> dict[str, Any]:
    """Run ``fn`` in a forked child that cannot write where the parent can: as root, setuid to
    nobody (root ignores permission bits); otherwise the caller's chmod already holds."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        status = 0
        try:
            os.close(read_fd)
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            result = json.dumps(fn())
        except BaseException:
            result, status = json.dumps({"error": traceback.format_exc()}), 1
        os.write(write_fd, result.encode())
        os._exit(status)
    os.close(write_fd)
    with os.fdopen(read_fd) as fh:
        text = fh.read()
    _, status = os.waitpid(pid, 0)
    result = json.loads(text)
    assert os.waitstatus_to_exitcode(status) == 0, result
    return result


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory another user can reach: under /tmp, as pytest's own is 0700 under root and
    TMPDIR may be a private directory (.ci/run's is)."""
    path = Path(tempfile.mkdtemp(prefix="hybridep-jit-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_read_only_cache_is_used_but_not_written(open_dir: Path, kernels: dict[str, Path]):
    """A cache mounted read-only, or another user's: its kernels are loaded, new ones are not
    written, one warning says so."""
    install = make_install(open_dir / "install", cache=open_dir / "cache", jit_home=open_dir)
    for path in open_dir.rglob("*"):
        if path.is_dir():
            path.chmod(0o755)
    install.run(compile={K_PRE: kernels[K_PRE]})
    home = open_dir / "home"  # the other user's own jit directory
    home.mkdir()
    home.chmod(0o1777)
    env = {**install.env, "HYBRID_EP_CACHE_DIR": str(home)}
    key_dir = install.key_dir()
    own = kernels[K_DISPATCH].read_bytes()
    if os.geteuid() != 0:
        key_dir.chmod(0o555)
    before = sorted(p.name for p in key_dir.iterdir())

    def rank() -> dict[str, Any]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cache = jit.prepare(env, arch="9.0", package_dir=install.package_dir, at_exit=False)
            loaded = sorted(p.name for p in cache.jit_dir.iterdir() if p.suffix == ".so")
            (cache.jit_dir / f"{K_DISPATCH}.so").write_bytes(own)
            published = cache.publish()
            cache.close()
        return {
            "uid": os.getuid(),
            "state": cache.state,
            "load": cache.load_cached_kernels,
            "loaded": loaded,
            "published": published,
            "warnings": [str(w.message) for w in caught],
        }

    try:
        result = _as_another_user(rank)
    finally:
        key_dir.chmod(0o755)
    assert result["state"] == "read-only" and result["load"] is True
    assert result["loaded"] == [f"{K_PRE}.so"]
    assert result["published"] == []
    assert len(result["warnings"]) == 1 and "read-only" in result["warnings"][0]
    assert result["uid"] != 0
    assert sorted(p.name for p in key_dir.iterdir()) == before


# ---- proc-<pid> directories ------------------------------------------------------------------


def _dead_pid() -> int:
    """The pid of a process that has ended and been reaped."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_stale_proc_dirs_are_removed_live_ones_kept(install: Install, tmp_path: Path):
    root = install.jit_root
    # A rank that is still running.
    ready = tmp_path / "ready"
    live = install.start(hold=str(ready))
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert live.poll() is None and time.monotonic() < deadline, live.communicate()
            time.sleep(0.05)
        # A rank that ended without its exit handlers (as after SIGKILL): its marker stays.
        dead = install.run(skip_exit_handlers=True)["pid"]
        marker = json.loads((root / f"proc-{dead}" / proc_dirs.MARKER).read_text())
        sleeper = subprocess.Popen(["sleep", "60"])
        try:
            # A dead rank's directory whose pid a later process (sleep) now has.
            reused = root / f"proc-{sleeper.pid}"
            reused.mkdir()
            (reused / proc_dirs.MARKER).write_text(json.dumps({**marker, "pid": sleeper.pid}))
            # Directories without a marker: HybridEP run without this module, maybe on another
            # host sharing this home. Removed only when their pid is not running here and they
            # are old.
            young, aged = root / f"proc-{_dead_pid()}", root / f"proc-{_dead_pid()}"
            running_old = root / f"proc-{os.getppid()}"
            for directory in (young, aged, running_old):
                directory.mkdir()
                (directory / f"{K_PRE}.so").write_bytes(b"x")
            old = time.time() - proc_dirs.UNPROVEN_MAX_AGE_S - 3600
            for directory in (aged, running_old):
                for path in (directory / f"{K_PRE}.so", directory):
                    os.utime(path, (old, old))
            foreign = None
            if os.geteuid() == 0:
                foreign = root / f"proc-{_dead_pid()}"
                foreign.mkdir()
                nobody = pwd.getpwnam("nobody")
                os.chown(foreign, nobody.pw_uid, nobody.pw_gid)
                os.utime(foreign, (old, old))

            cache = install.prepare()
            try:
                removed = set(cache.stale_removed)
                assert removed == {f"proc-{dead}", reused.name, aged.name}
                left = set(proc_dir_names(root))
                assert f"proc-{live.pid}" in left
                assert {young.name, running_old.name} <= left
                if foreign is not None:
                    assert foreign.name in left
                assert not any(p.name.startswith(".removing-") for p in root.iterdir())
            finally:
                cache.close()
        finally:
            sleeper.kill()
            sleeper.wait()
    finally:
        live.kill()
        live.communicate()


def test_a_leftover_dir_of_this_pid_is_emptied_first(install: Install, kernels: dict[str, Path]):
    """Containers reuse small pids: kernels another process left under this pid (another
    build, perhaps) must not be loaded by load_cached_kernels=True."""
    leftover = proc_dirs.jit_dir(install.env)
    leftover.mkdir(parents=True)
    (leftover / f"{K_PRE}.so").write_bytes(kernels[K_PRE].read_bytes())
    cache = install.prepare()
    try:
        assert cache.jit_dir == leftover
        assert so_files(leftover) == {}
        assert cache.load_cached_kernels is True
    finally:
        cache.close()


def test_two_buffers_in_one_process_share_the_directory(install: Install, kernels: dict[str, Path]):
    first = install.prepare()
    (first.jit_dir / f"{K_PRE}.so").write_bytes(kernels[K_PRE].read_bytes())
    second = install.prepare()
    assert second is first
    assert (first.jit_dir / f"{K_PRE}.so").exists(), "the second prepare must not empty it"
    first.close()
    assert first.jit_dir.is_dir()
    second.close()
    assert not first.jit_dir.exists()
    assert set(so_files(install.key_dir())) == {f"{K_PRE}.so"}


def test_a_forked_child_leaves_its_parents_directory(install: Install):
    cache = install.prepare()
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            cache.close()
            cache.close_at_exit()
            os._exit(0)
        os.waitpid(pid, 0)
        assert cache.jit_dir.is_dir()
    finally:
        cache.close()
    assert not cache.jit_dir.exists()


# ---- where things are ------------------------------------------------------------------------


def test_jit_dir_is_where_hybridep_compiles(tmp_path: Path):
    """HybridEP's get_jit_dir(): HYBRID_EP_CACHE_DIR, else the passwd home ($HOME is not read)."""
    pid = os.getpid()
    assert proc_dirs.jit_dir({"HYBRID_EP_CACHE_DIR": str(tmp_path)}) == (
        tmp_path / ".deepep" / "hybrid_ep" / "jit" / f"proc-{pid}"
    )
    home = pwd.getpwuid(os.getuid()).pw_dir
    assert proc_dirs.jit_dir({"HOME": str(tmp_path), "HYBRID_EP_CACHE_DIR": ""}) == (
        Path(home) / ".deepep" / "hybrid_ep" / "jit" / f"proc-{pid}"
    )


def test_cache_dir_and_arch_names():
    assert jit.cache_dir({}) == (jit.DEFAULT_CACHE, "default")
    assert jit.cache_dir({jit.CACHE_ENV: "off"}) == (None, jit.CACHE_ENV)
    assert jit.cache_dir({jit.CACHE_ENV: "/c"}) == ("/c", jit.CACHE_ENV)
    assert [cache_key.arch_label(a, {}) for a in ((9, 0), "9.0", "90", "sm_100a", "10.3")] == [
        "sm90",
        "sm90",
        "sm90",
        "sm100a",
        "sm103",
    ]


def test_the_cache_loads_only_the_standard_library():
    """It is loaded inside backend venvs, which hold only the lock's packages: importing it
    (with the registry package it lives in) loads no module from outside the standard library
    and ep_image."""
    code = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "import ep_image.backends.hybridep.jit_cache\n"
        "print(*sorted({name.split('.')[0] for name in set(sys.modules) - before}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    loaded = set(proc.stdout.split())
    assert "ep_image" in loaded
    outside = loaded - set(sys.stdlib_module_names) - {"ep_image"}
    assert not outside, outside


def test_the_buffer_step_says_off_not_none_when_the_cache_is_off(tmp_path: Path):
    """A run with EP_HYBRIDEP_JIT_CACHE=off read "JIT cache None off, 0 kernel(s) before"."""
    from ep_image.probes._ranks.gates import jit_cache_note

    env = {"EP_HYBRIDEP_JIT_CACHE": "off", "HYBRID_EP_CACHE_DIR": str(tmp_path)}
    off = jit.prepare(env, at_exit=False)
    note = jit_cache_note(off.facts())
    assert note.startswith("; JIT cache off (disabled (EP_HYBRIDEP_JIT_CACHE='off'))"), note
    assert "None" not in note
    on = {"jit_cache_state": "on", "jit_cache_dir": "/c", "jit_cache_files_before": 8}
    assert jit_cache_note(on) == "; JIT cache /c on, 8 kernel(s) before"
    assert jit_cache_note({}) == ""


# ---- a kernel swapped while it is placed; a jit directory that is not this user's -------------


def test_a_kernel_swapped_while_it_is_placed_is_never_linked(
    install: Install, kernels: dict[str, Path], tmp_path: Path
):
    """A writer (of this user) swaps a published kernel's file for another valid kernel and
    back, over and over, while prepare() runs. Before: checked by path, then linked by path,
    9 of 400 prepare() calls placed a kernel whose sha256 was not its record's. Now each
    kernel is opened once, checked and linked (or copied) from that one open file."""
    install.run(compile={K_DISPATCH: kernels[K_DISPATCH]})
    key_dir = install.key_dir()
    published = key_dir / f"{K_DISPATCH}.so"
    recorded = json.loads((key_dir / f"{K_DISPATCH}.so{kernel_files.PUBLISHED}").read_text())
    good, bad = tmp_path / "good.bin", tmp_path / "bad.bin"
    shutil.copy(published, good)
    bad.write_bytes(kernels[K_COMBINE].read_bytes())  # a valid kernel, not the published one
    stop = tmp_path / "stop"
    swapper = (
        "import os, sys\n"
        "target, good, bad, stop = sys.argv[1:5]\n"
        "temp = target + '.swap'\n"
        "while not os.path.exists(stop):\n"
        "    for src in (bad, good):\n"
        "        os.link(src, temp); os.rename(temp, target)\n"
    )
    racer = subprocess.Popen(
        [sys.executable, "-c", swapper, str(published), str(good), str(bad), str(stop)]
    )
    wrong, placed = 0, 0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(400):
                cache = install.prepare()
                try:
                    there = cache.jit_dir / f"{K_DISPATCH}.so"
                    if there.exists():
                        placed += 1
                        wrong += kernel_files.sha256(there) != recorded["sha256"]
                finally:
                    cache.close(publish=False)
    finally:
        stop.write_text("")
        racer.wait(timeout=60)
    assert placed > 0, "the test never placed the kernel"
    assert wrong == 0, f"{wrong} of {placed} placed kernels were not the published one"


@pytest.mark.skipif(os.geteuid() != 0, reason="another user's directory needs root to make")
def test_another_users_jit_directory_is_never_loaded_from(tmp_path: Path):
    """HybridEP loads from ``<HYBRID_EP_CACHE_DIR>/.deepep/hybrid_ep/jit/proc-<pid>``. In a
    shared (sticky) directory another user may have made that directory first, writable by
    all, with a kernel in it; a rank that cannot remove it must not tell HybridEP to load
    cached kernels from it (before: load_cached_kernels=True with the planted .so there)."""
    shared = Path(tempfile.mkdtemp(prefix="hybridep-shared-", dir="/tmp"))
    try:
        shared.chmod(0o755)
        install = make_install(shared / "install", cache=shared / "cache", jit_home=shared)
        for path in shared.rglob("*"):
            if path.is_dir():
                path.chmod(0o755)
        install.jit_root.mkdir(parents=True)
        for directory in (shared / ".deepep", install.jit_root.parent, install.jit_root):
            directory.chmod(0o1777)  # a shared scratch directory, sticky like /tmp
        (shared / "cache").mkdir()
        os.chown(shared / "cache", 65534, 65534)
        go_r, go_w = os.pipe()
        out_r, out_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child: a rank of user nobody
            status = 1
            try:
                os.close(go_w)
                os.close(out_r)
                os.read(go_r, 1)
                os.setgid(65534)
                os.setuid(65534)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    cache = jit.prepare(install.env, arch="9.0", package_dir=install.package_dir,
                                        at_exit=False)  # fmt: skip
                result = {
                    "load": cache.load_cached_kernels,
                    "reason": cache.reason,
                    "warnings": [str(w.message) for w in caught],
                    "dir": str(cache.jit_dir),
                    "refused": cache.refused_dir,
                }
                cache.close(publish=False)
                status = 0
            except BaseException:
                result = {"error": traceback.format_exc()}
            os.write(out_w, json.dumps(result).encode())
            os._exit(status)
        os.close(go_r)
        os.close(out_w)
        planted = install.jit_root / f"proc-{pid}"
        planted.mkdir()
        os.chown(planted, 4242, 4242)  # a third user's
        planted.chmod(0o777)
        (planted / f"{K_PRE}.so").write_bytes(elf_kernel(b"planted" * 100))
        os.write(go_w, b"g")
        os.close(go_w)
        with os.fdopen(out_r) as fh:
            result = json.loads(fh.read())
        os.waitpid(pid, 0)
        assert "error" not in result, result.get("error")
        assert result["refused"] == str(planted)
        assert result["dir"] != str(planted), "HybridEP would compile where another user writes"
        assert result["load"] is False, "HybridEP would load the planted kernel"
        assert "uid 4242" in result["reason"] or "others can write" in result["reason"], result
        assert "HYBRID_EP_CACHE_DIR" in result["reason"], result["reason"]
        assert len(result["warnings"]) == 1, result["warnings"]
    finally:
        shutil.rmtree(shared, ignore_errors=True)


# ---- a jit directory another user can move aside ---------------------------------------------

#: Where another user gets in, by case: the directory they can write (or own) on the way from
#: HYBRID_EP_CACHE_DIR's parent down to proc-<pid>, its mode, and whether nobody owns it.
_OPEN_JIT_CHAINS = {
    "base 0777 owned by nobody": ("base", 0o777, True),
    "base 0777": ("base", 0o777, False),
    "base owned by nobody": ("base", 0o755, True),
    ".deepep 0777": (".deepep", 0o777, False),
    "parent of base 0777": ("parent", 0o777, False),
}


@pytest.mark.parametrize("case", sorted(_OPEN_JIT_CHAINS))
def test_a_jit_directory_another_user_can_move_aside_is_refused(
    open_dir: Path, kernels: dict[str, Path], case: str
):
    """HYBRID_EP_CACHE_DIR in a directory another user can write without the sticky bit (or
    owns): they can rename the directory holding proc-<pid> aside and build their own, kernel
    included, in its place; before, prepare said "on" and loaded cached kernels with no
    warning. Every directory from the base's parent down is checked: the cache is off, one
    warning names the directory and the fix, and HybridEP is pointed (HYBRID_EP_CACHE_DIR) at
    a directory of this process's own, where the planted kernel is not; close() removes it and
    puts the variable back."""
    where, mode, nobody = _OPEN_JIT_CHAINS[case]
    if nobody and os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    install = make_install(open_dir / "install", cache=open_dir / "cache", jit_home=open_dir)
    for path in open_dir.rglob("*"):
        if path.is_dir():
            path.chmod(0o755)
    install.run(compile={K_PRE: kernels[K_PRE]})  # a published kernel the cache would load
    parent = open_dir / "scratch"
    base = parent / "base"
    (base / ".deepep").mkdir(parents=True)
    parent.chmod(0o755)
    base.chmod(0o755)
    (base / ".deepep").chmod(0o755)
    opened = {"parent": parent, "base": base, ".deepep": base / ".deepep"}[where]
    opened.chmod(mode)
    if nobody:
        os.chown(opened, 65534, 65534)
    install.env["HYBRID_EP_CACHE_DIR"] = str(base)
    asked = proc_dirs.jit_dir(install.env)
    before = os.environ.get("HYBRID_EP_CACHE_DIR")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = install.prepare()
    try:
        assert cache.state == "off" and cache.load_cached_kernels is False, cache.facts()
        assert cache.refused_dir == str(asked)
        private = cache.private_base
        assert private is not None and not cache.jit_dir.is_relative_to(parent)
        assert os.environ["HYBRID_EP_CACHE_DIR"] == str(private)
        assert proc_dirs.jit_dir(os.environ) == cache.jit_dir, "not where HybridEP compiles"
        assert proc_dirs.untrusted_chain(private, cache.jit_dir) is None
        assert so_files(cache.jit_dir) == {}
        (message,) = [str(w.message) for w in caught if "HybridEP JIT cache" in str(w.message)]
        assert str(asked) in message and str(opened) in message, message
        assert "Fix: set HYBRID_EP_CACHE_DIR" in message and "sticky" in message, message
        assert cache.facts()["jit_dir_refused"] == str(asked)
        assert install.prepare() is cache, "a second buffer shares the private directory"
        cache.close(publish=False)  # that second user's: the directory stays
        assert cache.jit_dir.is_dir()
        if os.geteuid() == 0:
            # What the warning is about, done for real by user nobody: the directory under
            # the open one goes aside and a tree with a kernel takes its place.
            victim = {"parent": base, "base": base / ".deepep", ".deepep": asked.parents[1]}[where]

            def plant() -> dict[str, Any]:
                os.rename(victim, victim.with_name(victim.name + ".aside"))
                asked.mkdir(parents=True)
                (asked / f"{K_PRE}.so").write_bytes(elf_kernel(b"planted" * 100))
                return {}

            _as_another_user(plant)
            assert (asked / f"{K_PRE}.so").exists()
            assert so_files(cache.jit_dir) == {}, "the planted kernel reached HybridEP"
    finally:
        cache.close(publish=False)
    assert not private.exists()
    assert os.environ.get("HYBRID_EP_CACHE_DIR") == before


def test_a_sticky_shared_jit_base_is_used(open_dir: Path, kernels: dict[str, Path]):
    """A base others can write but sticky (as /tmp, HybridEP's fallback): what is ours in it
    stays ours, so the cache is on and HybridEP compiles where it always does."""
    install = make_install(open_dir / "install", cache=open_dir / "cache", jit_home=open_dir)
    for path in open_dir.rglob("*"):
        if path.is_dir():
            path.chmod(0o755)
    install.run(compile={K_PRE: kernels[K_PRE]})
    base = open_dir / "scratch"
    base.mkdir()
    base.chmod(0o1777)
    install.env["HYBRID_EP_CACHE_DIR"] = str(base)
    cache = install.prepare()
    try:
        assert cache.state == "on" and cache.load_cached_kernels is True, cache.reason
        assert cache.jit_dir == proc_dirs.jit_dir(install.env) and cache.refused_dir is None
        assert so_files(cache.jit_dir) == {f"{K_PRE}.so": kernels[K_PRE].read_bytes()}
    finally:
        cache.close(publish=False)
