"""Build docker/Dockerfile for real with buildah on a CPU machine, then look inside the image.

What this proves, in the CI profile (below):
- an unknown EP fails within seconds, before the base stage starts, listing the valid values;
- the Dockerfile builds end to end from a local base image (no registry): ep-check, base, te
  (TE_BUILD=skip), the ep-<backend> stages through scripts/make_venv.py, and final;
- in an EP=deepep_v1,deepep_v2 image both venvs are there, their identical files share inodes
  (scripts/dedup.py ran in the layer that copied them), the active venv is the default
  (deepep_v2) and `use-ep --activate` / `EP_BACKEND=` switch it;
- the venv's cuDNN is loaded ahead of the base image's copy (the test base image carries an
  older libcudnn.so.9 in /usr/lib/x86_64-linux-gnu, as CUDA "cudnn" images do) and both
  versions are recorded in /opt/venvs/te-build.json, which says that TE was skipped;
- changing only EP rebuilds neither base nor te: they come from buildah's layer cache.

The CI profile, and what it leaves out (printed by the tests as well):
- TE_BUILD=skip: Transformer Engine is not compiled (hours on 2 cores, needs GitHub for its
  submodules); te-build.json records the skip.
- VENV_SKIP_PACKAGES: the largest CUDA libraries (cuBLAS, cuFFT, cuSOLVER, cuSPARSE(Lt),
  cuRAND, NCCL, NVSHMEM, NVRTC, CUPTI, nvJitLink, cuFile) and triton are not installed, so a
  venv is ~2.2 GB instead of ~5.3 GB; buildah's vfs driver copies every layer, and a 2-core CI
  machine has ~25 minutes for this file. torch and cuDNN stay (the backend's dist depends on
  torch; the cuDNN ordering is under test). Such an image cannot train.
- APT_PACKAGES without build-essential and git: nothing is compiled or cloned.
- hybridep is not built: its deep-ep is a git source and CI has no GitHub.
- No GPU: deep_ep is not imported (it needs the driver); probes/check_ep.py on a GPU does that.

The base image is Debian bookworm (debootstrap minbase + python3 + python3-venv +
ca-certificates) plus the stand-in base-image cuDNN; its root filesystem tarball is cached in
EP_IMAGE_TEST_CACHE (default /var/cache/ep-image-test) under a hash of the recipe, so only the
first run pays for debootstrap (~1 min). buildah's layer storage lives in a fresh directory
under that cache and is removed afterwards (vfs storage is ~25 GB for these builds); uv's
download cache (buildah's cache mount, ~1.2 GB) is kept there between runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
sys.path.insert(0, str(ROOT / "scripts"))

import ep_backends  # noqa: E402  (scripts/ is not a package)

CACHE = Path(os.environ.get("EP_IMAGE_TEST_CACHE", "/var/cache/ep-image-test"))

# The test base image: what a CUDA "cudnn" base image has that matters here, on Debian.
BASE_RECIPE = {
    "suite": "bookworm",
    "variant": "minbase",
    "include": ["python3", "python3-venv", "ca-certificates"],
    "mirror": "http://deb.debian.org/debian",
    # Stand-in for the base image's own cuDNN (an older release than the lock's).
    "base_cudnn": "nvidia-cudnn-cu13==9.14.0.64",
    "recipe_version": 1,
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
)
CI_PROFILE = {
    "TE_BUILD": "skip",
    "APT_PACKAGES": "python3 python3-venv ca-certificates",
    "VENV_SKIP_PACKAGES": " ".join(LEFT_OUT),
}
MULTI_EP = "deepep_v1,deepep_v2"
SINGLE_EP = "deepep_v2"


# --- fast checks (no buildah) ------------------------------------------------------------------


def test_hadolint_is_clean() -> None:
    result = subprocess.run(
        ["hadolint", str(DOCKERFILE)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_select_ep_knows_exactly_the_registry_backends() -> None:
    """docker/select-ep (shell, runs before Python exists) must list the registry's names."""
    text = (ROOT / "docker" / "select-ep").read_text()
    match = re.search(r'^BACKENDS="([^"]+)"', text, re.MULTILINE)
    assert match is not None
    assert tuple(match.group(1).split()) == ep_backends.BACKEND_NAMES
    every = subprocess.run(
        ["sh", str(ROOT / "docker" / "select-ep"), "all"], capture_output=True, text=True
    )
    assert tuple(every.stdout.split()) == ep_backends.BACKEND_NAMES


def test_every_build_arg_is_documented_with_a_default() -> None:
    """Official-image style: each ARG is declared before the first FROM, with a comment."""
    lines = DOCKERFILE.read_text().splitlines()
    first_from = next(i for i, line in enumerate(lines) if line.startswith("FROM "))
    top = {}
    for i, line in enumerate(lines[:first_from]):
        if line.startswith("ARG "):
            name = line[4:].split("=")[0]
            assert "=" in line, f"ARG {name} has no default"
            above = next(ln for ln in reversed(lines[:i]) if not ln.startswith("ARG "))
            assert above.startswith("#"), f"ARG {name} has no comment above it"
            top[name] = line
    used = {line.split()[1] for line in lines[first_from:] if line.startswith("ARG ")}
    assert used <= set(top), f"ARGs used in stages but not documented at the top: {used - set(top)}"


# --- buildah -------------------------------------------------------------------------------------


def ca_bundle() -> Path:
    """This machine's CA bundle (the file PIP_CERT names), passed to builds as a secret."""
    for name in ("PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"):
        if os.environ.get(name) and Path(os.environ[name]).is_file():
            return Path(os.environ[name])
    return Path("/etc/ssl/certs/ca-certificates.crt")


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

    def text(self) -> str:
        return "\n".join(self.log)


class Buildah:
    """buildah with its own storage (vfs, chroot isolation): isolated from other users."""

    def __init__(self, store: Path) -> None:
        self.store = store
        self.tmp = CACHE / "tmp"  # buildah's TMPDIR: holds the cache mounts (uv's cache)
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.flags = [
            "--root", str(store / "root"), "--runroot", str(store / "runroot"),
            "--storage-driver", "vfs",
        ]  # fmt: skip
        self.env = {**os.environ, "TMPDIR": str(self.tmp), "BUILDAH_ISOLATION": "chroot"}

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["buildah", *self.flags, *args], capture_output=True, text=True, env=self.env,
            check=check,
        )  # fmt: skip

    def bud(self, image: str, build_args: dict[str, str], log_name: str) -> Build:
        """Build docker/Dockerfile, streaming timestamped output to <store>/<log_name>.log."""
        cmd = ["buildah", *self.flags, "bud", "--isolation", "chroot", "--layers",
               "--format", "docker", "-f", str(DOCKERFILE), "-t", image,
               "--secret", f"id=ca-bundle,src={ca_bundle()}"]  # fmt: skip
        for key, value in build_args.items():
            cmd += ["--build-arg", f"{key}={value}"]
        log: list[str] = []
        started = time.monotonic()
        with (self.store / f"{log_name}.log").open("w") as sink:
            proc = subprocess.Popen(
                [*cmd, str(ROOT)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True, env=self.env,
            )  # fmt: skip
            assert proc.stdout is not None
            for line in proc.stdout:
                log.append(line.rstrip("\n"))
                sink.write(f"[{time.monotonic() - started:7.1f}s] {line}")
                sink.flush()
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

    def size(self, image: str) -> str:
        for entry in json.loads(self("images", "--json").stdout):
            if any(name.endswith(image) for name in entry.get("names") or []):
                return entry["size"]
        return "?"


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


@pytest.fixture(scope="module")
def buildah() -> Iterator[Buildah]:
    for tool in ("buildah", "debootstrap"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not installed (.ci/run installs it: apt-get install {tool})")
    if os.geteuid() != 0:
        pytest.skip("buildah with chroot isolation and debootstrap need root here")
    CACHE.mkdir(parents=True, exist_ok=True)
    store = Path(tempfile.mkdtemp(prefix="store-", dir=CACHE))
    tool = Buildah(store)
    try:
        yield tool
    finally:
        tool("rm", "--all", check=False)
        tool("rmi", "--all", "--force", check=False)
        shutil.rmtree(store, ignore_errors=True)


@pytest.fixture(scope="module")
def base_image(buildah: Buildah) -> str:
    """The test base image, committed into this run's storage from the cached rootfs tar."""
    started = time.monotonic()
    tar = base_rootfs_tar()
    name = f"localhost/ep-test-base:{recipe_key()}"
    ctr = buildah("from", "scratch").stdout.strip()
    buildah("add", ctr, str(tar), "/")
    buildah("config", "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "--cmd", "/bin/bash", ctr)  # fmt: skip
    buildah("commit", "--quiet", ctr, name)
    buildah("rm", ctr)
    print(f"base image {name} from {tar} in {time.monotonic() - started:.0f}s")
    return name


def build_args(base: str, ep: str) -> dict[str, str]:
    return {"BASE_IMAGE": base, "EP": ep, **CI_PROFILE}


@pytest.fixture(scope="module")
def multi_build(buildah: Buildah, base_image: str) -> Build:
    build = buildah.bud("ep-image:ci-multi", build_args(base_image, MULTI_EP), "multi")
    assert build.returncode == 0, build.text()[-6000:]
    return build


@pytest.fixture(scope="module")
def single_build(buildah: Buildah, base_image: str, multi_build: Build) -> Build:
    """EP changes, nothing else: built right after multi_build, on its layer cache."""
    build = buildah.bud("ep-image:ci-single", build_args(base_image, SINGLE_EP), "single")
    assert build.returncode == 0, build.text()[-6000:]
    return build


def announce_profile(capsys: pytest.CaptureFixture[str], lines: Sequence[str]) -> None:
    with capsys.disabled():
        print()
        for line in lines:
            print(f"  [image test] {line}")


PROBE = r"""
import ctypes, json, os, sys
from importlib import metadata
from pathlib import Path
prefix = Path(os.environ["EP_PREFIX"])
image = json.loads((prefix / "image.json").read_text())
active = os.readlink(prefix / "active")
backend = json.loads((prefix / active / "ep-backend.json").read_text())
ctypes.CDLL("libcudnn.so.9")
maps = [line.split()[-1] for line in open("/proc/self/maps") if "libcudnn.so" in line]
def ino(backend):
    lib = next((prefix / backend).glob("lib/python3*/site-packages/torch/lib/libtorch_cpu.so"))
    st = lib.stat()
    return [st.st_ino, st.st_nlink]
print("PROBE " + json.dumps({
    "python": os.path.realpath(sys.prefix),
    "active": active,
    "image": image,
    "dist": [backend["distribution"], metadata.version(backend["distribution"])],
    "marker": (next(Path(sys.prefix).glob("lib/python3*/site-packages"))
               / backend["marker_file"]).is_file(),
    "manifest": (prefix / "env-manifest.json").is_file(),
    "probes": sorted(p.name for p in Path("/opt/ep-image/probes").glob("check_*.py")),
    "stages": sorted(p.name for p in Path("/etc/ep-image/stages").glob("*.json")),
    "te_build": json.loads(Path(os.environ["EP_TE_BUILD_INFO"]).read_text()),
    "cudnn_loaded": maps[0] if maps else None,
    "ld_library_path": os.environ.get("LD_LIBRARY_PATH", ""),
    "torch_inodes": {b: ino(b) for b in image["backends"]},
    "dedup": json.loads((prefix / "dedup.json").read_text()),
}))
"""


def probe(buildah: Buildah, image: str, extra: str = "") -> tuple[dict, str]:
    script = (
        "set -e; python - <<'PY'\n" + PROBE + "PY\n"
        "echo DU-ALL $(du -s -B1 /opt/venvs | cut -f1);"
        "for v in /opt/venvs/deepep_*; do echo DU-ONE $(du -s -B1 $v | cut -f1); done;" + extra
    )
    out = buildah.run_in(image, script)
    data = json.loads(next(line[6:] for line in out.splitlines() if line.startswith("PROBE ")))
    return data, out


@pytest.mark.slow
def test_unknown_ep_fails_fast_listing_the_valid_values(
    buildah: Buildah, base_image: str, capsys: pytest.CaptureFixture[str]
) -> None:
    build = buildah.bud("ep-image:bogus", build_args(base_image, "deepep_v3"), "bogus")
    assert build.returncode != 0
    text = build.text()
    assert "unknown EP 'deepep_v3'" in text
    assert "valid EP values: deepep_v1, deepep_v2, hybridep, all" in text
    assert " AS base" not in text, "the base stage started before EP was checked"
    assert build.seconds < 60, f"took {build.seconds:.0f}s"
    announce_profile(capsys, [f"EP=deepep_v3 failed after {build.seconds:.1f}s:"] + [
        line for line in build.log if "select-ep:" in line
    ])  # fmt: skip


@pytest.mark.slow
def test_multi_backend_image(
    buildah: Buildah, multi_build: Build, capsys: pytest.CaptureFixture[str]
) -> None:
    data, out = probe(buildah, multi_build.image)
    # Both backends, the default active one, its distribution and layout.
    assert data["image"]["backends"] == ["deepep_v1", "deepep_v2"]
    assert data["active"] == "deepep_v2"
    assert data["python"] == "/opt/venvs/deepep_v2"
    assert data["dist"] == ["sgl-deep-ep", "0.1.2.post1"]
    assert data["marker"] is True
    assert data["manifest"] is True  # probes/check_env.py ran in the final stage
    assert "check_ep.py" in data["probes"]  # the probes ship in the image
    assert data["stages"] == ["deepep_v1.json", "deepep_v2.json", "hybridep.json"]
    # Deduplicated in the layer that copied them: torch is one inode shared by both venvs.
    inodes = data["torch_inodes"]
    assert inodes["deepep_v1"][0] == inodes["deepep_v2"][0]
    assert inodes["deepep_v1"][1] >= 2
    saved = data["dedup"]["bytes_before"] - data["dedup"]["bytes_after"]
    assert saved > 1_000_000_000, data["dedup"]
    du_all = int(re.search(r"DU-ALL (\d+)", out).group(1))
    du_each = [int(n) for n in re.findall(r"DU-ONE (\d+)", out)]
    assert du_all < 0.6 * sum(du_each)
    # te-build.json: TE skipped, and both cuDNN versions with the venv's first.
    te = data["te_build"]
    assert te["skipped"] is True
    runtime = te["cudnn_runtime"]
    assert runtime["staged"] is True
    assert runtime["venv_version"] == "9.24.0"
    assert runtime["base_image"]["version"] == "9.14.0"
    assert runtime["ldconfig_order"][0] == "/opt/venvs/active-cudnn/lib/libcudnn.so.9"
    # The base image's copy is still there (/usr/lib or, merged-/usr, /lib), just second.
    assert any(p.endswith("/x86_64-linux-gnu/libcudnn.so.9") for p in runtime["base_image"]["libs"])
    assert runtime["ldconfig_order"][1:] == runtime["base_image"]["libs"]
    assert data["cudnn_loaded"].startswith("/opt/venvs/deepep_v2/"), data["cudnn_loaded"]
    assert data["ld_library_path"].split(":")[0] == "/opt/venvs/active-cudnn/lib"
    announce_profile(capsys, [
        f"EP={MULTI_EP}: built in {multi_build.seconds:.0f}s, "
        f"image {buildah.size(multi_build.image)}",
        f"active {data['active']} ({data['dist'][0]} {data['dist'][1]}), python {data['python']}",
        f"torch inode shared {inodes}; dedup saved {saved / 2**30:.2f} GiB; "
        f"du /opt/venvs {du_all / 2**30:.2f} GiB vs {sum(du_each) / 2**30:.2f} GiB apart",
        f"cuDNN loaded: {data['cudnn_loaded']} (venv {runtime['venv_version']}, base image "
        f"{runtime['base_image']['version']} shadowed)",
        "CI profile: TE NOT BUILT (TE_BUILD=skip, te-build.json: skipped=true); "
        "hybridep NOT BUILT (git source, no GitHub); no GPU, deep_ep not imported",
        "CI profile: left out of every venv: " + " ".join(LEFT_OUT),
    ])  # fmt: skip


@pytest.mark.slow
def test_switching_backend_in_a_multi_backend_image(buildah: Buildah, multi_build: Build) -> None:
    script = (
        'EP_BACKEND=deepep_v1 /opt/ep-image/docker/ep-entrypoint sh -c '
        '\'echo "ENTRY $EP_BACKEND $(python -c "import sys; print(sys.prefix)")"\';'
        'eval "$(use-ep --activate deepep_v1)";'
        'echo "SWITCHED $EP_BACKEND $(readlink /opt/venvs/active) '
        '$(python -c "import os, sys; print(os.path.realpath(sys.prefix))") '
        '$(readlink -f /opt/venvs/active-cudnn)"'
    )  # fmt: skip
    out = buildah.run_in(multi_build.image, script)
    assert "ENTRY deepep_v1 /opt/venvs/deepep_v1" in out
    switched = next(line for line in out.splitlines() if line.startswith("SWITCHED"))
    assert switched.split()[1:4] == ["deepep_v1", "deepep_v1", "/opt/venvs/deepep_v1"]
    assert switched.split()[4].startswith("/opt/venvs/deepep_v1/")  # cuDNN follows `active`


@pytest.mark.slow
def test_changing_only_ep_reuses_base_and_te(
    buildah: Buildah, multi_build: Build, single_build: Build, capsys: pytest.CaptureFixture[str]
) -> None:
    assert single_build.step_cached("te-stage.sh"), "te stage was rebuilt"
    assert single_build.step_cached('"uv=='), "base stage (uv install) was rebuilt"
    assert single_build.step_cached("apt-get install"), "base stage (apt) was rebuilt"
    data, _ = probe(buildah, single_build.image)
    assert data["image"]["backends"] == ["deepep_v2"]
    assert data["active"] == "deepep_v2"
    assert data["dist"] == ["sgl-deep-ep", "0.1.2.post1"]
    assert list(data["torch_inodes"]) == ["deepep_v2"]
    announce_profile(capsys, [
        f"EP={SINGLE_EP} after EP={MULTI_EP}: {single_build.seconds:.0f}s "
        f"(first build {multi_build.seconds:.0f}s); base + te stages from cache; "
        f"image {buildah.size(single_build.image)}",
    ])  # fmt: skip
