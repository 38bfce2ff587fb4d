"""A real Docker Engine for the image tests: Debian's packages, a daemon of the run's own.

Why: users build the image with `docker build`, so the image tests build it with BuildKit as
well as buildah. Debian 12's own docker.io (20.10) lacks buildx, so the engine, its CLI and
buildx come from Debian 13 (trixie), and containerd and runc from Debian 12, whose builds need
only glibc 2.34. All are fetched with apt-get from Debian's archive through a source list of
their own (the machine's apt sources and package database are not touched) and unpacked with
`dpkg -x` into the test cache. dockerd then runs with its data, exec root, socket and config
under a directory of the run, without a bridge, iptables rules or IP forwarding (the machine's
network configuration stays as it was), and is stopped by its PID when the run ends, passing
or not, with every process and mount it left. What dockerd, containerd and runc write under /run
whatever their roots (a BuildKit container's runc state, a shim's socket, the directories
holding them) is recorded in the state directory before dockerd starts, so that the next run
removes it should this one be killed (``leftovers``), and nothing of another Docker's.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import _owned_dirs as owned_dirs
from _buildah import CACHE

MIRROR = "http://deb.debian.org/debian"
KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
#: (package, Debian suite): dockerd, the docker CLI and buildx from Debian 13; containerd and
#: runc from Debian 12 (Debian 13's runc needs glibc 2.38).
ENGINE = (
    ("docker.io", "trixie"),
    ("docker-cli", "trixie"),
    ("docker-buildx", "trixie"),
    ("containerd", "bookworm"),
    ("runc", "bookworm"),
)
#: Debian 12's own Docker (20.10, BuildKit 0.8, no buildx), to check the oldest Docker.
ENGINE_DEBIAN_12 = (("docker.io", "bookworm"), ("containerd", "bookworm"), ("runc", "bookworm"))
#: The oldest C library the Debian 13 binaries run on (their packages depend on libc6 >= 2.34).
GLIBC = (2, 34)
#: Directories under /run that dockerd, containerd and runc make whatever their roots are (no
#: flag moves them); those this run made are removed at its end, or by the next run, when empty.
RUN_DIRS = (Path("/run/docker/plugins"), Path("/run/docker"), Path("/run/containerd/s"),
            Path("/run/containerd"), Path("/run/runc"))  # fmt: skip
#: runc's default root: the state of the containers BuildKit runs for RUN steps inside dockerd.
RUNC_ROOT = Path("/run/runc")
#: Where containerd's shims put their sockets, named by a hash of containerd's address, the
#: namespace and the container's id.
SHIM_SOCKETS = Path("/run/containerd/s")
#: The record of what a daemon may leave outside its state directory, written there before it
#: starts (a run killed with SIGKILL cannot remove those; the next run reads this to).
OUTSIDE = "outside.json"


class EngineUnavailable(RuntimeError):
    """The engine cannot be had or started here; the message says why (a skip reason)."""


@dataclass(frozen=True)
class Installed:
    """An unpacked engine: its root, and the package versions it was unpacked from."""

    root: Path
    versions: dict[str, str]

    @property
    def docker(self) -> Path:
        return self.root / "usr" / "bin" / "docker"

    @property
    def dockerd(self) -> Path:
        return self.root / "usr" / "sbin" / "dockerd"

    @property
    def buildx(self) -> Path | None:
        plugin = self.root / "usr" / "libexec" / "docker" / "cli-plugins" / "docker-buildx"
        return plugin if plugin.is_file() else None

    @property
    def path(self) -> str:
        """PATH for dockerd: these binaries (containerd, runc) before the machine's."""
        dirs = [self.root / "usr" / "sbin", self.root / "usr" / "bin"]
        return os.pathsep.join([*map(str, dirs), "/usr/sbin", "/usr/bin", "/sbin", "/bin"])


def _stop_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started it dies (a killed test
    run), so that dockerd never outlives it (Linux PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)


def glibc() -> tuple[int, int]:
    """This machine's C library version (0, 0 where it is not glibc)."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # type: ignore[union-attr]
    except (ValueError, AttributeError, OSError):
        return (0, 0)
    major, minor = version.split(".")[:2]
    return (int(major), int(minor)) if name == "glibc" else (0, 0)


def why_not_here() -> str | None:
    """Why the engine cannot be fetched or run on this machine, or None."""
    if os.geteuid() != 0:
        return "dockerd needs root"
    for tool in ("apt-get", "dpkg-deb", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} not found: the engine comes from Debian's packages (Debian, Ubuntu)"
    if not KEYRING.is_file():
        return f"{KEYRING} missing (python3 scripts/bootstrap.py --tests installs it)"
    if glibc() < GLIBC:
        have, need = (".".join(map(str, v)) for v in (glibc(), GLIBC))
        return f"glibc {have}: Debian 13's docker needs glibc {need} or newer"
    return None


def _apt(lists: Path, *args: str, cwd: Path | None = None) -> None:
    """apt-get with a source list and state of its own under ``lists``."""
    options = [
        f"-oDir::Etc::SourceList={lists / 'sources.list'}", "-oDir::Etc::SourceParts=/dev/null",
        f"-oDir::State::Lists={lists / 'lists'}", f"-oDir::Cache={lists / 'cache'}",
        "-oDir::State::status=/dev/null", "-oAPT::Sandbox::User=root", "-qq",
    ]  # fmt: skip
    proc = subprocess.run(["apt-get", *options, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    if proc.returncode != 0:
        raise EngineUnavailable(
            f"apt-get {' '.join(args)} failed: {(proc.stderr or proc.stdout).strip()[-500:]}"
        )


def install(packages: tuple[tuple[str, str], ...] = ENGINE) -> Installed:
    """``packages`` unpacked under <cache>/docker-engine/<key>, fetched once (apt-get download
    from Debian's archive, signatures checked against Debian's keyring); later runs reuse them.
    ``rm -rf <cache>/docker-engine`` fetches the suites' current versions again."""
    key = hashlib.sha256(json.dumps([MIRROR, packages]).encode()).hexdigest()[:12]
    root = CACHE / "docker-engine" / key
    record = root / "versions.json"
    if record.is_file():
        return Installed(root, json.loads(record.read_text()))
    if reason := why_not_here():
        raise EngineUnavailable(reason)
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent) as tmp:
        work = Path(tmp)
        suites = sorted({suite for _, suite in packages})
        (work / "sources.list").write_text("".join(
            f"deb [signed-by={KEYRING}] {MIRROR} {suite} main\n" for suite in suites
        ))  # fmt: skip
        for sub in ("lists/partial", "cache/archives/partial", "debs", "root"):
            (work / sub).mkdir(parents=True)
        _apt(work, "update")
        _apt(work, "download", *(f"{name}/{suite}" for name, suite in packages), cwd=work / "debs")
        versions = {}
        for deb in sorted((work / "debs").glob("*.deb")):
            fields = subprocess.run(["dpkg-deb", "-f", str(deb), "Package", "Version"],
                                    capture_output=True, text=True, check=True).stdout  # fmt: skip
            info = dict(line.split(": ", 1) for line in fields.strip().splitlines())
            versions[info["Package"]] = info["Version"]
            subprocess.run(["dpkg-deb", "-x", str(deb), str(work / "root")], check=True)
        missing = {name for name, _ in packages} - set(versions)
        if missing:
            raise EngineUnavailable(f"apt-get download did not fetch {sorted(missing)}")
        (work / "root" / "versions.json").write_text(json.dumps(versions, indent=2) + "\n")
        if root.exists():  # a run that stopped half-way
            shutil.rmtree(root)
        (work / "root").rename(root)
    return Installed(root, versions)


@dataclass
class Daemon:
    """A running dockerd: its PID, socket, client configuration and state directory."""

    engine: Installed
    pid: int
    state: Path

    @property
    def host(self) -> str:
        return f"unix://{self.state / 'docker.sock'}"

    @property
    def secrets(self) -> Path:
        """A directory for the build secrets of the tests (mode 0700): inside the state, so they
        go with it, also when a killed run's state is removed by the next run."""
        return self.state / "secrets"

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a docker client of this daemon: its socket, and a client
        configuration whose cli-plugins/ holds this engine's buildx (a docker CLI elsewhere on
        PATH, without buildx, is never asked)."""
        return {**os.environ, "DOCKER_HOST": self.host,
                "DOCKER_CONFIG": str(self.state / "client"), **extra}  # fmt: skip

    def log_tail(self, lines: int = 20) -> str:
        path = self.state / "dockerd.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def _children(pid: int) -> list[int]:
    """The processes started by ``pid`` and their children, recursively."""
    found: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return found
    for task in tasks:
        with contextlib.suppress(OSError):
            for child in (task / "children").read_text().split():
                found += [int(child), *_children(int(child))]
    return found


@contextlib.contextmanager
def running(engine: Installed, parent: Path, timeout: float = 60) -> Iterator[Daemon]:
    """dockerd of ``engine`` with all its state in a new directory under ``parent``; stopped
    (SIGTERM, then SIGKILL after 30 s), its children and mounts gone and the directory removed
    when the block ends, however it ends."""
    owned = owned_dirs.make(parent, "docker-", leftovers)  # removes what killed runs left
    state = owned.path
    record_outside(state, [d for d in RUN_DIRS if not d.exists()])
    for sub in ("data", "exec", "client/cli-plugins"):
        (state / sub).mkdir(parents=True)
    (state / "secrets").mkdir(mode=0o700)
    (state / "daemon.json").write_text("{}\n")  # not the machine's /etc/docker/daemon.json
    if engine.buildx:
        (state / "client" / "cli-plugins" / "docker-buildx").symlink_to(engine.buildx)
    command = [
        str(engine.dockerd), "--config-file", str(state / "daemon.json"),
        "--data-root", str(state / "data"), "--exec-root", str(state / "exec"),
        "--pidfile", str(state / "dockerd.pid"), "-H", f"unix://{state / 'docker.sock'}",
        "--storage-driver=overlay2",
        # The machine's network configuration stays as it is: no bridge, no iptables rules,
        # no IP forwarding (dockerd turns net.ipv4.ip_forward on by default).
        "--bridge=none", "--iptables=false", "--ip6tables=false", "--ip-forward=false",
    ]  # fmt: skip
    log = (state / "dockerd.log").open("w")
    # Its own session: a Ctrl-C of the test run reaches the tests, which then stop dockerd in
    # order (below); should the run itself be killed, the kernel sends dockerd SIGTERM.
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PATH": engine.path},
                            preexec_fn=_stop_with_parent)  # fmt: skip
    daemon = Daemon(engine, proc.pid, state)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise EngineUnavailable(f"dockerd exited ({proc.returncode}): {daemon.log_tail()}")
            ping = subprocess.run(
                [str(engine.docker), "version", "--format", "{{.Server.Version}}"],
                capture_output=True, text=True, env=daemon.env(),
            )  # fmt: skip
            if ping.returncode == 0:
                break
            if time.monotonic() > deadline:
                raise EngineUnavailable(f"no answer in {timeout:.0f}s: {daemon.log_tail()}")
            time.sleep(0.3)
        yield daemon
    finally:
        # dockerd stops its containers and its containerd on SIGTERM; what is left after that
        # (a SIGKILL'd dockerd's containerd, a shim) is stopped by its PID.
        children = _children(proc.pid)
        owned_dirs.stop([proc.pid], grace=30)
        proc.wait()
        log.close()
        owned_dirs.stop([p for p in children if owned_dirs.alive(p)], grace=10)
        # What names the state, its mounts, the state, and what it recorded outside it.
        owned_dirs.remove(state, leftovers)
        owned.release()


def record_outside(state: Path, made: list[Path], run: Path = Path("/run")) -> None:
    """Write down, in ``state`` and before dockerd starts, where its daemon may leave things
    outside it: the directories under ``run`` this run makes (``made``: absent before it
    started), runc's roots (BuildKit's under ``run``, dockerd's own under the state), the shims'
    socket directory and containerd's address, whose hash names this daemon's sockets there."""
    record = {
        "made": [str(run / d.relative_to("/run")) for d in made],
        "runc_roots": [str(run / RUNC_ROOT.relative_to("/run")),
                       str(state / "exec" / "runtime-runc" / "moby")],
        "shim_sockets": str(run / SHIM_SOCKETS.relative_to("/run")),
        "containerd": str(state / "exec" / "containerd" / "containerd.sock"),
    }  # fmt: skip
    (state / OUTSIDE).write_text(json.dumps(record, indent=2) + "\n")


def _started(pid: int) -> int | None:
    """When ``pid`` started (clock ticks after boot, /proc's field 22): a PID's identity."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _cgroup_pids(cgroup: Path) -> list[int]:
    with contextlib.suppress(OSError, ValueError):
        return [int(line) for line in (cgroup / "cgroup.procs").read_text().split()]
    return []


def leftovers(state: Path) -> owned_dirs.Outside:
    """What the daemon of ``state`` left outside it, as its record (``record_outside``) and the
    state itself say; nothing without a record. Only what names this state is taken:

    - each runc container (BuildKit's RUN steps under runc's root, dockerd's under the state)
      whose root file system or state lies in ``state``: its init process (the PID and its start
      time, as runc wrote them), every process of its cgroups, its state directory and cgroups;
    - each shim socket whose name is the hash of this containerd's address, a namespace and a
      container of the state (a SIGKILL'd shim leaves it);
    - the directories the run made under /run, each removed when empty (an empty
      /run/docker/plugins is kept while another Docker's socket is beside it).
    """
    try:
        record = json.loads((state / OUTSIDE).read_text())
    except FileNotFoundError:
        return owned_dirs.Outside()
    outside = owned_dirs.Outside(made=[Path(d) for d in record.get("made", [])])
    # dockerd resolves its roots' symbolic links: what it wrote may name either path.
    inside = tuple(dict.fromkeys((f"{state}/", f"{os.path.realpath(state)}/")))
    for root in map(Path, record.get("runc_roots", [])):
        for found in sorted(root.glob("*/state.json")):
            try:
                container = json.loads(found.read_text())
            except (OSError, ValueError):
                continue
            rootfs = str((container.get("config") or {}).get("rootfs") or "")
            if not (rootfs.startswith(inside) or str(found).startswith(inside)):
                continue  # another daemon's container
            pid = container.get("init_process_pid")
            if (
                isinstance(pid, int)
                and pid > 0
                and _started(pid) == container.get("init_process_start")
            ):
                outside.pids.append(pid)
            for path in map(Path, (container.get("cgroup_paths") or {}).values()):
                if str(path).startswith("/sys/fs/cgroup/"):
                    outside.pids += _cgroup_pids(path)
                    outside.cgroups.append(path)
            if not str(found).startswith(inside):
                outside.entries.append(found.parent)
    sockets, address = Path(record.get("shim_sockets", SHIM_SOCKETS)), record.get("containerd")
    tasks = state / "exec" / "containerd" / "daemon" / "io.containerd.runtime.v2.task"
    named = {(p.parent.name, p.name) for p in tasks.glob("*/*")}
    named |= {("moby", p.name) for p in (state / "data" / "containers").glob("*")}
    addresses = dict.fromkeys((address, os.path.realpath(address))) if address else {}
    for (namespace, container_id), where in itertools.product(sorted(named), addresses):
        name = hashlib.sha256(f"{where}/{namespace}/{container_id}".encode()).hexdigest()
        if os.path.lexists(sockets / name):
            outside.entries.append(sockets / name)
    return outside
