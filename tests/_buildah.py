"""The image tests' buildah harness, shared with tests/bench_image.py so both measure alike."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import pytest
from _progress import Progress

ROOT = Path(__file__).resolve().parents[1]

#: The image tests' cache: the base image's rootfs tarball, uv's download cache (buildah's cache
#: mount, <cache>/buildah-cache) and the build logs (<cache>/logs), kept between runs.
CACHE = Path(os.environ.get("EP_IMAGE_TEST_CACHE", "/var/cache/ep-image-test"))

# The test base image: what a CUDA "cudnn" base image has that matters here, on Debian.
BASE_RECIPE = {
    "suite": "bookworm",
    "variant": "minbase",
    "include": ["python3", "python3-venv", "ca-certificates", "git"],
    "mirror": "http://deb.debian.org/debian",
    # Stand-in for the base image's own cuDNN (an older release than the lock's).
    "base_cudnn": "nvidia-cudnn-cu13==9.14.0.64",
    "recipe_version": 2,
}

LEFT_OUT = (
    "nvidia-cublas",
    "nvidia-cufft",
    "nvidia-cusolver",
    "nvidia-cusparse",
    "nvidia-cusparselt-cu13",
    "nvidia-curand",
    "nvidia-nccl-cu13",
    "nvidia-nvshmem-cu13",
    "nvidia-cuda-nvrtc",
    "nvidia-cuda-cupti",
    "nvidia-nvjitlink",
    "nvidia-cufile",
    "triton",
    # DeepEP v1 and HybridEP: built from git (GitHub is out of reach here, and the real builds
    # take an hour of nvcc on 2 cores); the image tests' stand-in proves the git-source path.
    "deep-ep",
)
#: The CI profile (tests/test_image_build.py's docstring says what it leaves out and why).
CI_PROFILE = {
    "TE_BUILD": "skip",
    "APT_PACKAGES": "python3 python3-venv ca-certificates git",
    "VENV_SKIP_PACKAGES": " ".join(LEFT_OUT),
}


def build_args(base: str, ep: str) -> dict[str, str]:
    """The CI profile's build arguments for ``EP=ep`` on the base image ``base``."""
    return {"BASE_IMAGE": base, "EP": ep, **CI_PROFILE}


def ca_bundle() -> Path:
    """This machine's CA bundle (the file PIP_CERT names), passed to builds as a secret."""
    for name in ("PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"):
        if os.environ.get(name) and Path(os.environ[name]).is_file():
            return Path(os.environ[name])
    return Path("/etc/ssl/certs/ca-certificates.crt")


# --- the storage ---------------------------------------------------------------------------------


def storage_driver(parent: Path) -> tuple[str, str]:
    """The storage driver for this run's buildah, and why.

    overlay shares each layer with the next (copy on write); vfs copies the whole file system
    for every instruction, which costs minutes and tens of GB per build here (docs/image.md).
    overlay when the kernel mounts it on ``parent``'s file system, else vfs, which works
    everywhere. EP_IMAGE_TEST_STORAGE_DRIVER=vfs|overlay forces one.
    """
    forced = os.environ.get("EP_IMAGE_TEST_STORAGE_DRIVER", "")
    if forced:
        if forced not in ("vfs", "overlay"):
            raise ValueError(f"EP_IMAGE_TEST_STORAGE_DRIVER={forced!r}: use vfs or overlay")
        return forced, "EP_IMAGE_TEST_STORAGE_DRIVER"
    trial = Path(tempfile.mkdtemp(prefix="overlay-trial-", dir=parent))
    mounted = False
    try:
        for name in ("lower", "upper", "work", "merged"):
            (trial / name).mkdir()
        (trial / "lower" / "file").write_text("lower\n")
        options = f"lowerdir={trial / 'lower'},upperdir={trial / 'upper'},workdir={trial / 'work'}"
        mount = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", options,
                                str(trial / "merged")], capture_output=True, text=True)  # fmt: skip
        mounted = mount.returncode == 0
        if not mounted:
            return "vfs", f"no overlay mount on {parent}: {mount.stderr.strip()}"
        if (trial / "merged" / "file").read_text() != "lower\n":
            return "vfs", f"an overlay mount on {parent} did not show its lower layer"
        return "overlay", f"the kernel mounts overlay on {parent}"
    finally:
        if mounted:
            subprocess.run(["umount", str(trial / "merged")], check=False)
        subprocess.run(["rm", "-rf", "--one-file-system", str(trial)], check=False)


def store_parent() -> Path:
    """Where a storage goes: EP_IMAGE_TEST_STORE_PARENT (.ci/run points that at a directory it
    removes whatever happens), else the cache directory."""
    CACHE.mkdir(parents=True, exist_ok=True)
    return Path(os.environ.get("EP_IMAGE_TEST_STORE_PARENT") or CACHE)


def layer_chain(root: Path, driver: str, tag: str) -> list[dict]:
    """The layer records of the image named ``...tag``, its top layer first, from
    containers/storage's own ``<driver>-images``/``<driver>-layers`` records."""
    images = json.loads((root / f"{driver}-images" / "images.json").read_text())
    records = json.loads((root / f"{driver}-layers" / "layers.json").read_text())
    layers = {x["id"]: x for x in records}
    entry = next(i for i in images if any(n.endswith(tag) for n in i.get("names") or []))
    chain, layer = [], entry["layer"]
    while layer:
        chain.append(layers[layer])
        layer = layers[layer].get("parent")
    return chain


def image_bytes(root: Path, driver: str, tag: str) -> int:
    """Sum of ``diff-size`` along the layer chain of the image named ``...tag`` (uncompressed,
    each layer once): what the image adds up to, not what ``du`` of one container shows."""
    return sum(layer.get("diff-size") or 0 for layer in layer_chain(root, driver, tag))


def unmount_under(path: Path) -> None:
    """Unmount what an interrupted overlay build left mounted under ``path``, deepest first,
    so that ``rm --one-file-system`` removes the whole storage."""
    mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    # The kernel names a mount point by its resolved path.
    unders = tuple(dict.fromkeys((f"{path}/", f"{os.path.realpath(path)}/")))
    for point in sorted((m for m in mounts if m.startswith(unders)), reverse=True):
        subprocess.run(["umount", "-l", point], check=False)


def du(path: Path) -> int:
    """Disk bytes under path (`du -s -B1`), 0 if it is gone."""
    proc = subprocess.run(["du", "-s", "-B1", str(path)], capture_output=True, text=True)
    return int(proc.stdout.split()[0]) if proc.returncode == 0 else 0


def interrupt(signum: int, frame: object) -> None:
    """SIGTERM (a CI timeout, `kill`) as Ctrl-C: cleanup in ``finally`` blocks then runs."""
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def sigterm_as_ctrl_c() -> Iterator[None]:
    """Within the block, SIGTERM raises KeyboardInterrupt (see ``interrupt``)."""
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# --- buildah -------------------------------------------------------------------------------------


class _NoCapture:
    """Stands in for pytest.Config outside pytest: Progress then prints straight to stderr."""

    class pluginmanager:  # the attribute Progress reads
        @staticmethod
        def get_plugin(name: str) -> None:
            return None


def progress(config: pytest.Config | None, label: str) -> Progress:
    """Progress lines under pytest's capture (``config``), or on stderr outside pytest (None)."""
    return Progress(config if config is not None else cast(pytest.Config, _NoCapture()), label)


@dataclass
class Build:
    """One `buildah bud`: its image, exit code, output and wall time."""

    image: str
    returncode: int
    log: list[str]
    seconds: float

    def step_cached(self, needle: str) -> bool:
        """Whether the step whose instruction contains `needle` came from the layer cache."""
        for i, line in enumerate(self.log):
            if "STEP" in line and needle in line:
                return any("Using cache" in nxt for nxt in self.log[i + 1 : i + 3])
        raise AssertionError(f"no step containing {needle!r} in the build log")

    def cached_steps(self) -> int:
        """How many steps came from the layer cache (buildah's `Using cache` lines)."""
        return sum("Using cache" in line for line in self.log)

    def stages_visited(self) -> list[str]:
        """Names of the stages buildah started (`[n/m] STEP 1/k: FROM ... AS name`)."""
        return re.findall(r"STEP 1/\d+: FROM \S+ AS (\S+)", self.text())

    def text(self) -> str:
        return "\n".join(self.log)


#: What buildah's chroot runner prints when sealing the memfd copy of itself fails (EBUSY).
MEMFD_SEAL_FAULT = "sealing memfd copy: Device or resource busy"


class Buildah:
    """buildah with its own storage (chroot isolation): isolated from other users.

    ``config`` is pytest's (progress lines get past its capture) or None outside pytest;
    ``label`` starts each progress line.
    """

    def __init__(
        self,
        store: Path,
        config: pytest.Config | None,
        driver: str = "vfs",
        label: str = "image test",
    ) -> None:
        self.store = store
        self.driver = driver
        self.config = config
        self.label = label
        self.logs = CACHE / "logs"  # kept after the storage is removed, for a look at a failure
        self.logs.mkdir(parents=True, exist_ok=True)
        # buildah's TMPDIR: its temporary files die with the storage; the cache mounts (uv's
        # download cache, TMPDIR/buildah-cache) are kept in the cache directory between runs.
        self.tmp = store / "tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        (CACHE / "buildah-cache").mkdir(parents=True, exist_ok=True)
        (self.tmp / "buildah-cache").symlink_to(CACHE / "buildah-cache")
        self.flags = [
            "--root", str(store / "root"), "--runroot", str(store / "runroot"),
            "--storage-driver", driver,
        ]  # fmt: skip
        self.env = {**os.environ, "TMPDIR": str(self.tmp), "BUILDAH_ISOLATION": "chroot"}

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["buildah", *self.flags, *args], capture_output=True, text=True, env=self.env,
            check=check,
        )  # fmt: skip

    def bud(
        self,
        image: str,
        build_args: dict[str, str],
        log_name: str,
        context: Path = ROOT,
        secrets: dict[str, Path] | None = None,
        target: str | None = None,
    ) -> Build:
        """Build docker/Dockerfile, printing each stage as it starts (and a heartbeat); the
        output goes to <cache>/logs/<log_name>.log as well, each line with its time.

        A RUN that fails before its command starts because the kernel refused to seal the
        runtime's memfd copy of itself (EBUSY, seen once in CI) is an infrastructure fault, not
        the build's: that build is run once more, and the layer cache resumes it at the RUN.
        """
        build = self._bud_once(image, build_args, log_name, context, secrets, target)
        if build.returncode != 0 and any(MEMFD_SEAL_FAULT in line for line in build.log):
            print(f"{log_name}: buildah could not seal its memfd copy (EBUSY); building again")
            build = self._bud_once(image, build_args, f"{log_name}-again", context, secrets, target)
        return build

    def _bud_once(
        self,
        image: str,
        build_args: dict[str, str],
        log_name: str,
        context: Path,
        secrets: dict[str, Path] | None,
        target: str | None,
    ) -> Build:
        dockerfile_path = str(context / "docker" / "Dockerfile")
        cmd = ["buildah", *self.flags, "bud", "--isolation", "chroot", "--layers",
               "--format", "docker", "-f", dockerfile_path, "-t", image]  # fmt: skip
        for key, path in {"ca-bundle": ca_bundle(), **(secrets or {})}.items():
            cmd += ["--secret", f"id={key},src={path}"]
        for key, value in build_args.items():
            cmd += ["--build-arg", f"{key}={value}"]
        if target:
            cmd += ["--target", target]
        log: list[str] = []
        started = time.monotonic()
        with (
            progress(self.config, f"{self.label}: {log_name}") as reporter,
            (self.logs / f"{log_name.replace(':', '-')}.log").open("w") as sink,
        ):
            proc = subprocess.Popen(
                [*cmd, str(context)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True, env=self.env,
            )  # fmt: skip
            assert proc.stdout is not None
            for line in proc.stdout:
                line = line.rstrip("\n")
                log.append(line)
                sink.write(f"[{time.monotonic() - started:7.1f}s] {line}\n")
                sink.flush()
                if " STEP 1/" in line or line.startswith("STEP 1/"):
                    reporter.say(line[:110])
                elif "STEP" in line:
                    reporter.note(line[:110])
            proc.wait()
        return Build(image, proc.returncode, log, time.monotonic() - started)

    def run_in(self, image: str, script: str) -> str:
        """Run `sh -c script` in a new container of image; return its stdout."""
        ctr = self("from", image).stdout.strip()
        try:
            result = self(
                "run", "--isolation", "chroot", ctr, "--", "sh", "-c", script, check=False
            )
        finally:
            self("rm", ctr, check=False)
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    @contextlib.contextmanager
    def mounted(self, image: str) -> Iterator[Path]:
        """The root file system of a new container of ``image``, mounted here."""
        ctr = self("from", image).stdout.strip()
        try:
            yield Path(self("mount", ctr).stdout.strip())
        finally:
            self("umount", ctr, check=False)
            self("rm", ctr, check=False)

    def size(self, image: str) -> int:
        """Bytes of the image's layers, from the storage's records (``image_bytes``)."""
        return image_bytes(self.store / "root", self.driver, image)

    def layers(self, image: str) -> list[dict]:
        """The image's layer records, top first (``layer_chain``)."""
        return layer_chain(self.store / "root", self.driver, image)

    def remove_storage(self) -> None:
        """Every container and image, then the storage directory itself (what an interrupted
        overlay build left mounted is unmounted first)."""
        self("rm", "--all", check=False)
        self("rmi", "--all", "--force", check=False)
        unmount_under(self.store)
        subprocess.run(["rm", "-rf", "--one-file-system", str(self.store)], check=False)


# --- the test base image -------------------------------------------------------------------------


def recipe_key() -> str:
    return hashlib.sha256(json.dumps(BASE_RECIPE, sort_keys=True).encode()).hexdigest()[:16]


def plant_base_cudnn(rootfs: Path, work: Path) -> None:
    """Put an older cuDNN where CUDA cudnn images keep theirs (lib + versioned header)."""
    target = work / "cudnn"
    subprocess.run(
        ["uv", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
         BASE_RECIPE["base_cudnn"]],
        check=True, timeout=900,
    )  # fmt: skip
    header = (target / "nvidia/cudnn/include/cudnn_version.h").read_bytes()
    library = (target / "nvidia/cudnn/lib/libcudnn.so.9").read_bytes()
    libdir = rootfs / "usr/lib/x86_64-linux-gnu"
    incdir = rootfs / "usr/include/x86_64-linux-gnu"
    incdir.mkdir(parents=True, exist_ok=True)
    numbers = re.findall(rb"#define CUDNN_(?:MAJOR|MINOR|PATCHLEVEL) (\d+)", header)
    version = ".".join(n.decode() for n in numbers[:3])
    (incdir / "cudnn_version_v9.h").write_bytes(header)
    (rootfs / "usr/include/cudnn_version.h").symlink_to("x86_64-linux-gnu/cudnn_version_v9.h")
    (libdir / f"libcudnn.so.{version}").write_bytes(library)
    (libdir / "libcudnn.so.9").symlink_to(f"libcudnn.so.{version}")
    subprocess.run(["chroot", str(rootfs), "ldconfig"], check=True)


def base_rootfs_tar() -> Path:
    """The cached root filesystem tarball of the test base image (built on first use)."""
    tar = CACHE / f"base-{recipe_key()}.tar.gz"
    if tar.is_file():
        return tar
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as work:
        rootfs = Path(work) / "rootfs"
        subprocess.run(
            ["debootstrap", f"--variant={BASE_RECIPE['variant']}",
             "--include=" + ",".join(BASE_RECIPE["include"]), BASE_RECIPE["suite"],
             str(rootfs), BASE_RECIPE["mirror"]],
            check=True, capture_output=True, timeout=1200,
        )  # fmt: skip
        plant_base_cudnn(rootfs, Path(work))
        partial = tar.with_suffix(".partial")
        with tarfile.open(partial, "w:gz", compresslevel=1) as out:
            out.add(rootfs, arcname=".")
        partial.rename(tar)
    return tar


def commit_base_image(buildah: Buildah) -> str:
    """The test base image, committed into ``buildah``'s storage from the cached rootfs tarball
    (debootstrap on the first run only); returns its name."""
    tar = base_rootfs_tar()
    name = f"localhost/ep-test-base:{recipe_key()}"
    ctr = buildah("from", "scratch").stdout.strip()
    buildah("add", ctr, str(tar), "/")
    buildah("config", "--env",
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "--cmd", "/bin/bash", ctr)  # fmt: skip
    buildah("commit", "--quiet", ctr, name)
    buildah("rm", ctr)
    return name
