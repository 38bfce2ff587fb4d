"""Build docker/Dockerfile for real with buildah on a CPU machine, then look inside the images.

What this proves, in the CI profile (below), with one buildah storage and one base image for
every build here:
- the generated stages match the backend registry; every ARG is documented; hadolint is clean;
- an unknown EP fails within seconds, before the base stage starts, listing the valid values;
- EP=deepep_v1-deepep_v2 builds end to end from a local base image (no registry): both venvs,
  their identical files sharing inodes (the skeletons deduplicated in venvs-common's layer),
  each venv equal, file by file, to the one its ep-<backend> stage built, and the assembly's
  layers holding no more than those stages added; the default backend active,
  `use-ep --activate` and `EP_BACKEND=` switching it, the venv's cuDNN loaded ahead of the base
  image's older copy, both recorded; stages EP does not select (the hybridep venv, the other
  image-<EP> assemblies) are never built;
- then EP=deepep_v2 on the same storage reuses *every* backend stage (base, te, ep-deepep_v2
  from the layer cache; ep-deepep_v1 not even visited) and only assembles;
- an air-gapped git source: HybridEP's stage clones its pinned git source through a
  `gitconfig` build secret whose url.<mirror>.insteadOf sends uv to a bare repository served
  from this machine by `git daemon`. Without the secret the same build fails naming the fix;
  with it, the stand-in HybridEP (tests/fixtures/fake_hybridep.py) is built with make_venv's
  NVSHMEM set-up, the same code host mode runs (tests/test_make_venv.py), and no layer holds
  the secret.

The CI profile, and what it leaves out (printed by the tests as well):
- TE_BUILD=skip: Transformer Engine is not compiled (hours on 2 cores, needs GitHub for its
  submodules); te-build.json records the skip.
- VENV_SKIP_PACKAGES: the largest CUDA libraries (cuBLAS, cuFFT, cuSOLVER, cuSPARSE(Lt),
  cuRAND, NCCL, NVSHMEM, NVRTC, CUPTI, nvJitLink, cuFile) and triton are not installed, so a
  venv is ~2.2 GB instead of ~5.3 GB (buildah's vfs driver, the fallback where the kernel
  cannot mount overlay, copies every layer). torch and cuDNN stay (the backend's dist depends
  on torch; the cuDNN ordering is under test). Such an image cannot train.
- APT_PACKAGES without build-essential: nothing is compiled in the image.
- The real DeepEP v1 and HybridEP are not built (their git source needs GitHub and an hour of
  nvcc): VENV_SKIP_PACKAGES also leaves out `deep-ep`, so the deepep_v1 venv holds everything
  but its own distribution; the stand-in proves the build path around them.
- No GPU: deep_ep is not imported (it needs the driver); check_ep on a GPU does that.

The base image is Debian bookworm (debootstrap minbase + python3, python3-venv, ca-certificates,
git) plus the stand-in base-image cuDNN; its root filesystem tarball is cached in
EP_IMAGE_TEST_CACHE (default /var/cache/ep-image-test) under a hash of the recipe, so only the
first run pays for debootstrap. buildah's layer storage is a fresh directory under that cache,
removed at the end, also when a test fails; uv's download cache (buildah's cache mount) is kept
in <cache>/buildah-cache between runs. The buildah runner, the CI profile and the base image are
tests/_buildah.py's, shared with the image benchmark (tests/bench_image.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import takewhile
from pathlib import Path

import _owned_dirs as owned_dirs
import fake_hybridep
import pytest
from _buildah import (
    LEFT_OUT,
    Build,
    Buildah,
    build_args,
    commit_base_image,
    du,
    sigterm_as_ctrl_c,
    storage_driver,
    store_parent,
)
from _progress import Progress
from _venv_helpers import tree_differences
from test_source_build import fake_cuda, rdma_home

from ep_image import backends, pins
from ep_image.build_steps._source_builds import nvshmem
from ep_image.build_steps._uv import pinned
from ep_image.repo import dockerfile

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
BOOTSTRAP_TESTS = "python3 -m ep_image.build_steps.bootstrap --tests"


MULTI_EP = "all"
SINGLE_EP = "deepep_v2"


# --- fast checks (no buildah) ------------------------------------------------------------------


def test_hadolint_is_clean() -> None:
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint missing: it comes with the dev group (uv sync --group dev)"
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_frontend_image_is_fetched() -> None:
    """No `# syntax=` parser directive: BuildKit would pull that frontend image from a registry
    before building anything, which an air-gapped builder cannot."""
    directives = takewhile(
        lambda m: m is not None,
        (re.match(r"#\s*(\w+)\s*=", line) for line in DOCKERFILE.read_text().splitlines()),
    )  # parser directives end at the file's first line that is not one
    assert "syntax" not in {m.group(1).lower() for m in directives if m}


def test_generated_stages_match_the_registry() -> None:
    """ep-<backend> and image-<EP> stages are the registry's, rendered; nothing stale."""
    text = DOCKERFILE.read_text()
    assert dockerfile.splice(text, dockerfile.render()) == text, (
        "docker/Dockerfile is stale: run `python -m ep_image.repo.dockerfile --write`"
    )
    stages = re.findall(r"^FROM \S+ AS (\S+)$", text, re.MULTILINE)
    assert [s[3:] for s in stages if s.startswith("ep-") and s != "ep-check"] == list(
        backends.BACKEND_NAMES
    )
    assert [s[6:] for s in stages if s.startswith("image-")] == [
        v for v, _ in backends.image_ep_values()
    ]
    # The EP default and its buildah-1.28 fallback in `final` are the registry's default.
    assert f"ARG EP={backends.DEFAULT_BACKEND}\n" in text
    assert f"FROM image-${{EP:-{backends.DEFAULT_BACKEND}}} AS final\n" in text
    assert f"ARG UV_VERSION={pinned.UV_VERSION}\n" in text


def test_select_ep_accepts_exactly_the_image_stages() -> None:
    """docker/select-ep (shell, runs before Python exists) reads the Dockerfile's stages."""

    def select(ep: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["sh", str(ROOT / "docker" / "select-ep"), ep, str(DOCKERFILE)],
                              capture_output=True, text=True)  # fmt: skip

    for value, _ in backends.image_ep_values():
        assert select(value).stdout.strip() == value
    bad = select("deepep_v1,deepep_v2")
    assert bad.returncode == 2 and "EP=all" in bad.stderr and "host mode" in bad.stderr
    assert "EP=all" in select("deepep_v1-deepep_v2").stderr
    listed = re.search(r"valid EP values: (.*)", bad.stderr).group(1).split(", ")
    assert listed == [v for v, _ in backends.image_ep_values()]
    for wrong in ("", "deepep_v3", "deepep_v2-deepep_v1", "image-all", "deepep.*"):
        assert select(wrong).returncode == 2, wrong


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


def test_input_stages_hold_what_the_build_steps_import(tmp_path: Path) -> None:
    """te-inputs / venv-inputs copy single files and whole packages; each build step (a module,
    or a package with its ``__main__``) must run from just those."""
    text = DOCKERFILE.read_text()
    for stage, step in (("te-inputs", "build_te"), ("venv-inputs", "make_venv")):
        body = text.split(f"AS {stage}\n", 1)[1].split("\nFROM ", 1)[0]
        copies = re.findall(r"^COPY ((?:[^\n\\]|\\\n)+)$", body, re.MULTILINE)
        root = tmp_path / stage
        for copy in copies:
            if copy.startswith("--from=") or "${" in copy:
                continue  # another stage's output, or the TE source: not the steps' imports
            *sources, dest = copy.replace("\\\n", " ").split()
            for source in sources:
                if (ROOT / source).is_dir():  # COPY dir/ dest/: the directory's content
                    target = root / dest.removeprefix("/opt/ep-image/")
                    shutil.copytree(
                        ROOT / source, target, ignore=shutil.ignore_patterns("__pycache__")
                    )
                    continue
                target = root / dest.removeprefix("/opt/ep-image/") / Path(source).name
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(ROOT / source, target)
        # Every step the stage holds (make_venv runs dedup as a subprocess), importing only the
        # stage's copy of the package: no PYTHONPATH to this checkout.
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        steps = root / "ep_image" / "build_steps"
        held = [*steps.glob("[!_]*.py"), *(p.parent for p in steps.glob("[!_]*/__main__.py"))]
        for command in sorted(held):
            module = f"ep_image.build_steps.{command.stem}"
            proc = subprocess.run([sys.executable, "-m", module, "--help"], cwd=root, env=env,
                                  capture_output=True, text=True)  # fmt: skip
            assert proc.returncode == 0, f"{stage} lacks a module {module} imports:\n{proc.stderr}"
        assert (steps / step / "__main__.py").is_file() or (steps / f"{step}.py").is_file()


def test_storage_driver_is_overlay_only_where_it_mounts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The image tests' driver: a forced value wins, a wrong one is refused, and the automatic
    choice is overlay exactly when a real overlay mount on that file system shows its lower
    layer (as root), else vfs with the reason."""
    monkeypatch.setenv("EP_IMAGE_TEST_STORAGE_DRIVER", "vfs")
    assert storage_driver(tmp_path)[0] == "vfs"
    monkeypatch.setenv("EP_IMAGE_TEST_STORAGE_DRIVER", "btrfs")
    with pytest.raises(ValueError, match="use vfs or overlay"):
        storage_driver(tmp_path)
    monkeypatch.delenv("EP_IMAGE_TEST_STORAGE_DRIVER")
    driver, why = storage_driver(tmp_path)
    if os.geteuid() != 0:
        assert driver == "vfs" and "no overlay mount" in why
    assert driver in ("overlay", "vfs") and str(tmp_path) in why
    assert list(tmp_path.iterdir()) == [], "the trial mount left files behind"


# --- buildah -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def buildah(pytestconfig: pytest.Config) -> Iterator[Buildah]:
    """One storage for every build of this module, removed afterwards (also on failure or
    SIGTERM).

    It lives under EP_IMAGE_TEST_STORE_PARENT (.ci/run points that at a directory it removes
    whatever happens) or the cache directory.
    """
    for tool in ("buildah", "debootstrap", "git"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not installed ({BOOTSTRAP_TESTS} installs it)")
    if os.geteuid() != 0:
        pytest.skip("buildah with chroot isolation and debootstrap need root here")
    parent = store_parent()
    owned = owned_dirs.make(parent, "store-")  # and removes what killed runs left there
    store = owned.path
    driver, why = storage_driver(parent)
    announce(pytestconfig, [f"buildah storage driver: {driver} ({why})"])
    tool = Buildah(store, pytestconfig, driver)
    try:
        with sigterm_as_ctrl_c():
            yield tool
    finally:
        with Progress(pytestconfig, "image test: cleanup") as progress:
            progress.say(f"removing buildah storage {store} ({du(store) / 2**30:.1f} GiB)")
            tool.remove_storage()
            owned.release()


@pytest.fixture(scope="module")
def base_image(buildah: Buildah, pytestconfig: pytest.Config) -> str:
    """The test base image, committed into this run's storage from the cached rootfs tar."""
    with Progress(pytestconfig, "image test: base image") as progress:
        progress.say("debootstrap (first run only) and commit of the base image")
        return commit_base_image(buildah)


@dataclass
class Built:
    """A finished image: its build(s), its size, and the stages they visited."""

    image: str
    seconds: float
    size: int
    builds: list[Build]

    def stages_visited(self) -> list[str]:
        return [stage for build in self.builds for stage in build.stages_visited()]


def build_image(buildah: Buildah, base: str, ep: str, tag: str, targets: list[str]) -> Built:
    """The EP image, after building ``targets`` (its backend stages, its assembly) each alone.

    buildah keeps a full copy of the file system per instruction until a build ends (vfs), so
    building the big backend stages one invocation at a time bounds the disk peak; the final
    invocation finds them in the layer cache, as an EP switch does.
    """
    builds = []
    for target in targets:
        build = buildah.bud(f"{tag}-{target}", build_args(base, ep), f"{tag}-{target}",
                            target=target)  # fmt: skip
        assert build.returncode == 0, build.text()[-6000:]
        builds.append(build)
    build = buildah.bud(tag, build_args(base, ep), tag)
    assert build.returncode == 0, build.text()[-6000:]
    builds.append(build)
    # The targets' tags stay: `buildah rmi` of a tag removes the image and its untagged
    # parents, which would empty the layer cache the next EP's build is meant to hit.
    return Built(tag, sum(b.seconds for b in builds), buildah.size(tag), builds)


@pytest.fixture(scope="module")
def multi_build(buildah: Buildah, base_image: str) -> Iterator[Built]:
    # The assembly stage on its own too: its working copies (the venvs before dedup) are gone
    # before `final` makes its own copy of the image (measured: the peak was at `final`).
    targets = [*(f"ep-{name}" for name in backends.BACKEND_NAMES), f"image-{MULTI_EP}"]
    built = build_image(buildah, base_image, MULTI_EP, "ep-image:ci-multi", targets)
    yield built
    buildah("rmi", built.image, check=False)


@pytest.fixture(scope="module")
def single_build(buildah: Buildah, base_image: str, multi_build: Built) -> Iterator[Build]:
    """EP changes, nothing else: built right after multi_build, on its layer cache.

    The multi image itself goes first (its tests are done; its size is recorded): its layers
    are a full image's worth of disk, and the backend stages stay in the cache without it.
    """
    buildah("rmi", multi_build.image, check=False)
    build = buildah.bud("ep-image:ci-single", build_args(base_image, SINGLE_EP), "single")
    assert build.returncode == 0, build.text()[-6000:]
    yield build
    buildah("rmi", build.image, check=False)


def announce(pytestconfig: pytest.Config, lines: list[str]) -> None:
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():
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
    "probes": sorted(p.name for p in Path(sys.prefix, "bin").glob("check-*")),
    "registry": Path("/opt/ep-image/ep_image/backends/__init__.py").is_file(),
    "stages": sorted(p.name for p in Path("/etc/ep-image/stages").glob("*.json")),
    "etc": sorted(p.name for p in Path("/etc/ep-image").iterdir()),
    "te_build": json.loads(Path(os.environ["EP_TE_BUILD_INFO"]).read_text()),
    "cudnn_loaded": maps[0] if maps else None,
    "ld_library_path": os.environ.get("LD_LIBRARY_PATH", ""),
    "jit_cache_dir": os.environ.get("EP_JIT_CACHE_DIR"),
    "hybridep_jit_cache": os.environ.get("EP_HYBRIDEP_JIT_CACHE"),
    "torch_inodes": {b: ino(b) for b in image["backends"]},
    "dedup": json.loads((prefix / "dedup.json").read_text()),
    "common": json.loads((prefix / "venvs-common.json").read_text()),
    "venvs": sorted(p.name for p in prefix.iterdir()
                    if (p / "pyvenv.cfg").is_file() and not p.is_symlink()),
}))
"""


def probe(buildah: Buildah, image: str, extra: str = "") -> tuple[dict, str]:
    script = (
        "set -e; python - <<'PY'\n" + PROBE + "PY\n"
        "echo DU-ALL $(du -s -B1 /opt/venvs | cut -f1);"
        "for v in /opt/venvs/*/ep-backend.json; do"
        " echo DU-ONE $(du -s -B1 ${v%/*} | cut -f1); done;" + extra
    )
    out = buildah.run_in(image, script)
    data = json.loads(next(line[6:] for line in out.splitlines() if line.startswith("PROBE ")))
    return data, out


@pytest.mark.slow
def test_unknown_ep_fails_fast_listing_the_valid_values(
    buildah: Buildah, base_image: str, pytestconfig: pytest.Config
) -> None:
    build = buildah.bud("ep-image:bogus", build_args(base_image, "deepep_v3"), "bogus")
    assert build.returncode != 0
    text = build.text()
    assert "unknown EP 'deepep_v3'" in text
    values = ", ".join(v for v, _ in backends.image_ep_values())
    assert f"valid EP values: {values}" in text
    assert " AS base" not in text, "the base stage started before EP was checked"
    assert build.seconds < 60, f"took {build.seconds:.0f}s"
    announce(pytestconfig, [f"EP=deepep_v3 failed after {build.seconds:.1f}s:"] + [
        line for line in build.log if "select-ep:" in line
    ])  # fmt: skip


@pytest.mark.slow
def test_multi_backend_image(
    buildah: Buildah, multi_build: Built, pytestconfig: pytest.Config
) -> None:
    data, out = probe(buildah, multi_build.image)
    # Every backend, the default active one, its distribution and layout.
    assert data["image"]["backends"] == list(backends.BACKEND_NAMES)
    assert data["image"]["ep"] == MULTI_EP
    assert data["active"] == backends.DEFAULT_BACKEND == "deepep_v2"
    assert data["python"] == "/opt/venvs/deepep_v2"
    assert data["dist"] == ["sgl-deep-ep", "0.1.2.post1"]
    assert data["marker"] is True
    assert data["manifest"] is True  # check-env ran in the final stage
    assert {"check-ep", "check-train"} <= set(data["probes"])  # the active venv's bin/ holds them
    assert data["registry"] is True  # and the registry they import
    # Only the selected stages were built, and nothing writes records nobody reads.
    assert data["stages"] == [f"{name}.json" for name in sorted(backends.BACKEND_NAMES)]
    assert data["etc"] == ["stages"]
    visited = multi_build.stages_visited()
    assert {*(f"ep-{n}" for n in backends.BACKEND_NAMES), f"image-{MULTI_EP}"} <= set(visited)
    last = multi_build.builds[-1]
    for name in backends.BACKEND_NAMES:  # built by the targeted runs, then from the cache
        assert last.step_cached(f"--backend {name} "), f"ep-{name} was built twice"
    assert not [s for s in visited if s.startswith("image-") and s != f"image-{MULTI_EP}"]
    # Deduplicated in venvs-common's layer: torch is one inode shared by every venv.
    inodes = data["torch_inodes"]
    assert len({inode for inode, _links in inodes.values()}) == 1, inodes
    assert min(links for _inode, links in inodes.values()) >= len(backends.BACKEND_NAMES)
    assert data["common"]["skeletons"] == list(backends.BACKEND_NAMES)
    saved = data["common"]["dedup"]["saved_bytes"]
    assert saved > 1_000_000_000, data["common"]
    assert data["venvs"] == sorted(backends.BACKEND_NAMES)
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
    # DeepEP v2's JIT cache has one documented place in the image (a volume keeps it).
    assert data["jit_cache_dir"] == "/var/cache/ep-jit/deep_ep"
    assert data["hybridep_jit_cache"] == "/var/cache/ep-jit/hybrid_ep"
    announce(pytestconfig, [
        f"EP={MULTI_EP}: built in {multi_build.seconds:.0f}s, "
        f"image {multi_build.size / 1e9:.2f} GB",
        f"active {data['active']} ({data['dist'][0]} {data['dist'][1]}), python {data['python']}",
        f"torch inode shared {inodes}; dedup saved {saved / 2**30:.2f} GiB; "
        f"du /opt/venvs {du_all / 2**30:.2f} GiB vs {sum(du_each) / 2**30:.2f} GiB apart",
        f"cuDNN loaded: {data['cudnn_loaded']} (venv {runtime['venv_version']}, base image "
        f"{runtime['base_image']['version']} shadowed)",
        f"stages built: {' '.join(visited)}",
        "CI profile: TE NOT BUILT (TE_BUILD=skip, te-build.json: skipped=true); "
        "real deepep_v1 and hybridep NOT BUILT (git sources, no GitHub; a stand-in is, "
        "below); no GPU",
        "CI profile: left out of every venv: " + " ".join(LEFT_OUT),
    ])  # fmt: skip


@pytest.mark.slow
def test_multi_backend_assembly_is_each_stage_venv_and_only_its_files(
    buildah: Buildah, multi_build: Built, pytestconfig: pytest.Config
) -> None:
    """Each venv of the multi-backend image is, file by file, the one its ep-<backend> stage
    built; the assembly's own layers hold only what those stages added to venvs-common."""
    names = list(backends.BACKEND_NAMES)
    stage_images = {n: f"{multi_build.image}-ep-{n}" for n in names}
    started = time.monotonic()
    with buildah.mounted(multi_build.image) as image_root:
        for name, stage in stage_images.items():
            with buildah.mounted(stage) as stage_root:
                venv = f"opt/venvs/{name}"
                assert tree_differences(image_root / venv, stage_root / venv) == [], name
    compared = time.monotonic() - started
    # The layers: venvs-common's chain is what every stage shares; each stage adds its own.
    chains = {n: [x["id"] for x in reversed(buildah.layers(s))] for n, s in stage_images.items()}
    rows = zip(*chains.values(), strict=False)  # the shortest chain ends the comparison
    common = [row[0] for row in takewhile(lambda row: len(set(row)) == 1, rows)]
    sizes = {
        x["id"]: x.get("diff-size") or 0 for n in names for x in buildah.layers(stage_images[n])
    }
    own = {n: sum(sizes[x] for x in chains[n][len(common) :]) for n in names}
    image_chain = [x["id"] for x in reversed(buildah.layers(multi_build.image))]
    assert image_chain[: len(common)] == common, "the image does not start from venvs-common"
    added = sum(x.get("diff-size") or 0 for x in buildah.layers(multi_build.image)) - sum(
        sizes[x] for x in common
    )
    assert added < sum(own.values()) + 16 * 2**20, (added, own)
    log = multi_build.builds[-2].text()  # the image-<EP> target's build, where the RUN ran
    synced = re.findall(r"image_stage: (\S+) from ep-\S+ onto its skeleton .*?\((\S+) MB\) written",
                        log)  # fmt: skip
    assert [n for n, _ in synced] == names, log[-3000:]
    announce(pytestconfig, [
        f"EP={MULTI_EP}: each venv equal to its stage's (compared in {compared:.0f}s); "
        f"the assembly added {added / 2**20:.1f} MiB over venvs-common "
        "(the stages' own layers: "
        + ", ".join(f"{n} {v / 2**20:.1f} MiB" for n, v in own.items()) + "; "
        f"written by the sync: {', '.join(f'{n} {mb} MB' for n, mb in synced)})",
    ])  # fmt: skip


@pytest.mark.slow
def test_the_probe_files_run_from_the_images_workdir(buildah: Buildah, multi_build: Built) -> None:
    """README's `docker run IMAGE probes/check_ep.py`: through the image's entrypoint,
    relative to its WORKDIR, with the active venv's python (the CPU profile's torch lacks its
    CUDA libraries, so here the probe shows its help and check_env runs whole)."""
    entry = "/opt/ep-image/docker/ep-entrypoint"
    script = (
        f'echo "PWD $(pwd)"; {entry} probes/check_ep.py --help > /tmp/help.txt; '
        'echo "HELP-RC $?"; head -1 /tmp/help.txt; '
        f"{entry} probes/check_env.py --json /tmp/env.json > /dev/null; "
        'echo "ENV-RC $?"; '
        'python -c \'import json; print("ENV-PY", json.load(open("/tmp/env.json"))'
        '["environment"]["python"])\''
    )
    out = buildah.run_in(multi_build.image, script)
    assert "PWD /opt/ep-image" in out
    assert "HELP-RC 0" in out and "usage: check-ep" in out, out
    assert "ENV-RC 0" in out, out
    assert "ENV-PY /opt/venvs/active/bin/python" in out, out


@pytest.mark.slow
def test_switching_backend_in_a_multi_backend_image(buildah: Buildah, multi_build: Built) -> None:
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
def test_changing_only_ep_reuses_every_backend_stage(
    buildah: Buildah, multi_build: Built, single_build: Build, pytestconfig: pytest.Config
) -> None:
    assert single_build.step_cached("apt-get install"), "base stage (apt) was rebuilt"
    assert single_build.step_cached('"uv=='), "base stage (uv install) was rebuilt"
    assert single_build.step_cached("ep_image.build_steps.build_te"), "te stage was rebuilt"
    assert single_build.step_cached("--backend deepep_v2 "), "venv was rebuilt"
    visited = single_build.stages_visited()
    assert "ep-deepep_v1" not in visited and "ep-hybridep" not in visited, visited
    assert f"image-{SINGLE_EP}" in visited
    data, _ = probe(buildah, single_build.image)
    assert data["image"]["backends"] == ["deepep_v2"]
    assert data["active"] == "deepep_v2"
    assert data["dist"] == ["sgl-deep-ep", "0.1.2.post1"]
    assert list(data["torch_inodes"]) == ["deepep_v2"]
    assert data["stages"] == ["deepep_v2.json"]
    assert data["venvs"] == ["deepep_v2"], "a skeleton EP does not select is left"
    multi, single = multi_build.size, buildah.size(single_build.image)
    assert multi <= 1.03 * single, f"the other backends cost {multi / single:.3f}x (target 1.03x)"
    # One backend: the image is its venv's stage plus small layers; the venv is not copied.
    venv_stage = buildah.layers(f"{multi_build.image}-ep-{SINGLE_EP}")
    above = list(takewhile(lambda layer: layer["id"] != venv_stage[0]["id"],
                           buildah.layers(single_build.image)))  # fmt: skip
    added = sum(layer.get("diff-size") or 0 for layer in above)
    assert single == buildah.size(f"{multi_build.image}-ep-{SINGLE_EP}") + added, (
        f"image-{SINGLE_EP} does not start from the ep-{SINGLE_EP} stage's layers"
    )
    assert added < 64 * 2**20, f"the one-backend assembly added {added / 2**20:.0f} MiB"
    announce(pytestconfig, [
        f"EP={SINGLE_EP} after EP={MULTI_EP}: {single_build.seconds:.0f}s "
        f"(first build {multi_build.seconds:.0f}s); base, te and ep-deepep_v2 from cache, "
        f"stages visited: {' '.join(visited)}",
        f"image sizes: {MULTI_EP} {multi / 1e9:.2f} GB, {SINGLE_EP} {single / 1e9:.2f} GB "
        f"({multi / single:.3f}x); {SINGLE_EP} = its venv stage + {added / 2**20:.1f} MiB "
        f"in {len(above)} layers",
    ])  # fmt: skip


# --- an air-gapped git source: the gitconfig secret ------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def git_mirror(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """`git daemon` serving tmp/DeepEP.git on 127.0.0.1: the build machine's git mirror."""
    root = tmp_path_factory.mktemp("mirror")
    (root / "DeepEP.git").mkdir()
    port = free_port()
    daemon = subprocess.Popen(
        ["git", "daemon", "--export-all", "--reuseaddr", "--listen=127.0.0.1",
         f"--port={port}", f"--base-path={root}", str(root)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        for _ in range(50):
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        yield root, f"git://127.0.0.1:{port}/DeepEP.git"
    finally:
        daemon.terminate()
        daemon.wait(timeout=10)


@pytest.fixture(scope="module")
def fake_context(git_mirror: tuple[Path, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A build context: this repository's files with a project whose hybridep is the fake."""
    root, _url = git_mirror
    version = pins.locked_versions(ROOT, nvshmem.DISTRIBUTION).pop()
    fake = fake_hybridep.make(root, version, dict(os.environ))
    context = tmp_path_factory.mktemp("context")
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, files):
        if (ROOT / name).is_file() and not name.startswith(
            ("tests/", "docs/", "evidence/", ".github/")
        ):
            (context / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, context / name)
    for name in ("pyproject.toml", "uv.lock"):
        shutil.copy(fake.project / name, context / name)
    return context


def with_source_build_tools(buildah: Buildah, base: str, work: Path) -> str:
    """``base`` plus what make_venv's preflight asks of a source build (an nvcc that prints its
    release, the driver stubs, rdma-core's headers), as stand-ins: the stand-in HybridEP
    compiles with cc, and a CUDA toolkit would not fit a 2-core CI machine's disk."""
    name = f"{base}-source-build-tools"
    ctr = buildah("from", base).stdout.strip()
    try:
        buildah("copy", ctr, str(fake_cuda(work / "cuda")), "/usr/local/cuda")
        buildah("copy", ctr, str(rdma_home(work / "rdma") / "include"), "/usr/include")
        buildah("commit", "--quiet", ctr, name)
    finally:
        buildah("rm", ctr, check=False)
    return name


@pytest.mark.slow
def test_git_source_builds_through_the_gitconfig_secret(
    buildah: Buildah,
    base_image: str,
    git_mirror: tuple[Path, str],
    fake_context: Path,
    tmp_path: Path,
    pytestconfig: pytest.Config,
) -> None:
    _root, mirror = git_mirror
    buildah("rmi", "ep-image:ci-single", check=False)  # done with; its disk is needed here
    base = with_source_build_tools(buildah, base_image, tmp_path / "tools")
    args = {**build_args(base, "hybridep"), "VENV_SKIP_PACKAGES": ""}
    # Without the secret: the clone goes to github.com and fails; the message names the fix.
    offline = buildah.bud("ep-image:hybridep-offline", args, "hybridep-offline", fake_context,
                          target="ep-hybridep")  # fmt: skip
    assert offline.returncode != 0
    text = offline.text()
    assert "could not clone the git source of deep-ep" in text, text[-3000:]
    assert "gitconfig" in text and "insteadOf" in text

    config = fake_hybridep.gitconfig(tmp_path / "gitconfig", mirror)
    build = buildah.bud("ep-image:hybridep-fake", args, "hybridep-fake", fake_context,
                        secrets={"gitconfig": config}, target="ep-hybridep")  # fmt: skip
    assert build.returncode == 0, build.text()[-6000:]
    assert "with-secrets: git reads the gitconfig secret (1 insteadOf rule(s))" in build.text()
    out = buildah.run_in(build.image, (
        "set -e; sp=$(echo /opt/venvs/hybridep/lib/python3*/site-packages);"
        "echo BUILD-ENV $(python3 -c \"import json,sys; print(json.dumps(json.load(open("
        "sys.argv[1]))))\" $sp/deep_ep/_build_env.json);"
        "echo NVSHMEM $(python3 -c \"import json; print(json.dumps(json.load(open("
        "'/opt/venvs/hybridep/ep-backend.json'))['nvshmem_build']))\");"
        "ldd $sp/deep_ep_cpp*.so | grep nvshmem;"
        "echo DIRECT-URL $(cat $sp/deep_ep-*.dist-info/direct_url.json);"
        "echo LEAKS $(grep -rIl --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev "
        f"'{mirror}' / 2>/dev/null | head -5);"
        "echo SECRETS $(ls -A /run/secrets 2>/dev/null | wc -l) files"
    ))  # fmt: skip
    line = {ln.split(" ", 1)[0]: ln.split(" ", 1)[1] for ln in out.splitlines() if " " in ln}
    # make_venv's NVSHMEM set-up, the same one host mode runs (tests/test_make_venv.py).
    fake_hybridep.assert_built_by_make_venv(json.loads(line["BUILD-ENV"]), "/opt/venvs", True)
    assert json.loads(line["NVSHMEM"])["extension"]["runpath"] == ["$ORIGIN/nvidia/nvshmem/lib"]
    assert "/opt/venvs/hybridep/lib/python3" in out.split("libnvshmem_host.so.3 =>")[1]
    # The commit came from the mirror, recorded under its real URL; the secret left no trace.
    assert fake_hybridep.UPSTREAM in line["DIRECT-URL"]
    assert line.get("LEAKS", "") == "", f"files naming the mirror: {line['LEAKS']}"
    assert line["SECRETS"] == "0 files", "a secret was left in the image"
    history = buildah("inspect", "--type", "image", build.image).stdout
    assert mirror not in history and "insteadOf" not in history
    buildah("rmi", build.image, check=False)
    announce(pytestconfig, [
        f"hybridep (stand-in) from the mirror {mirror} via the gitconfig secret: built in "
        f"{build.seconds:.0f}s; without the secret it failed in {offline.seconds:.0f}s "
        "naming the fix",
    ])  # fmt: skip
