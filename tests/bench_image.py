"""The image benchmark of docs/image.md: a cold EP=all build, EP switches, sizes and sharing.

Why: the figures docs/image.md quotes (cold EP=all, then EP switches on the same storage; each
image's footprint; the bytes each backend's venv holds alone) come from this script, so anyone
can rerun them, built and measured by the image tests' own harnesses: buildah
(tests/_buildah.py), or a Docker Engine from Debian's packages with BuildKit
(tests/_docker_engine.py, tests/_docker.py).

Run as root from the repository root, after `uv sync --group dev`:

    uv run --frozen --group dev python3 tests/bench_image.py                     # buildah
    uv run --frozen --group dev python3 tests/bench_image.py --builder docker    # BuildKit
    uv run --frozen --group dev python3 tests/bench_image.py --builder docker-20.10

In this order, on one fresh storage (removed at the end, also on failure, Ctrl-C or SIGTERM):
cold EP=all as `venvs-common`, each `ep-<backend>` stage and then the image, one invocation
each (bounds the vfs disk peak); then EP=<the default backend>, then EP=<another backend>.
The CI profile of the image tests: TE_BUILD=skip, the big CUDA libraries and `deep-ep` (the
git source of DeepEP v1 and HybridEP, which a machine without GitHub cannot clone) left out.
The base image is the image tests' (its rootfs tarball cached in EP_IMAGE_TEST_CACHE; the first
run pays for debootstrap), as is uv's download cache.

Prints, on stdout: `BENCH <build> <seconds> s` per build; `CACHED <switch> <n> steps` (steps
from the layer cache) and `visited: <stage>` (the stages the default backend's switch started);
`SIZE <image> ...` (sum of `diff-size` along each image's layer chain in buildah's storage
records); `UNIQUE <backend> ...` (in the EP=all image, `st_size` of every inode seen in exactly
one /opt/venvs/<backend>) and `SHARED ...` (inodes in two or more venvs). Progress lines go to
stderr, each build's log to <cache>/logs/bench-<build>.log.

With --builder docker (Docker 26 and buildx from Debian 13) or docker-20.10 (Debian 12's own
Docker, its built-in BuildKit), the same builds in the same order run on a dockerd of the
script's own, its state in a fresh directory removed at the end; `SIZE` is then dockerd's
figure for the image (its layers, uncompressed, each once), `CACHED` counts BuildKit's CACHED
steps, `RAN <switch> <stage>` names each stage of which a step ran, and `RUN <image>
probes/check_env.py exit <n>` says whether the image runs (`docker run`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

from _buildah import (
    ROOT,
    Build,
    Buildah,
    base_rootfs_tar,
    build_args,
    ca_bundle,
    commit_base_image,
    recipe_key,
    sigterm_as_ctrl_c,
    storage_driver,
    store_parent,
)
from _docker import Docker, DockerBuild
from _docker_engine import ENGINE, ENGINE_DEBIAN_12, EngineUnavailable, install, running

MULTI_EP = "all"
#: --builder: the Docker Engines, as Debian packages them (tests/_docker_engine.py).
ENGINES = {"docker": ENGINE, "docker-20.10": ENGINE_DEBIAN_12}


class BuildFailed(Exception):
    """A benchmark build exited non-zero."""


def registry(flag: str) -> list[str]:
    """Lines of ``python3 -m ep_image.backends FLAG``: the backend registry, as the .sh read it."""
    proc = subprocess.run([sys.executable, "-m", "ep_image.backends", flag], cwd=ROOT,
                          capture_output=True, text=True, check=True)  # fmt: skip
    return proc.stdout.splitlines()


def switch_values() -> tuple[str, str]:
    """The EP values to switch to after the cold build: the default backend alone, then
    another backend alone (both from the registry's image EP values)."""
    default = registry("--default")[0]
    alone = [value for value, backends in (line.split("\t") for line in registry("--image-ep"))
             if backends == value]  # fmt: skip
    other = next(value for value in alone if value != default)
    return default, other


def venv_sharing(venvs: Path) -> tuple[dict[str, int], int, int]:
    """Over the backend venvs under ``venvs`` (directories with ep-backend.json, no symlinks):
    the bytes of regular-file inodes each venv alone holds, the bytes of inodes two or more
    hold, and the bytes of all their inodes (each counted once)."""
    owners: dict[tuple[int, int], tuple[int, set[str]]] = {}
    for venv in sorted(venvs.iterdir()):
        if venv.is_symlink() or not (venv / "ep-backend.json").is_file():
            continue
        for dirpath, _dirs, files in os.walk(venv):
            for name in files:
                st = os.lstat(os.path.join(dirpath, name))
                if stat.S_ISREG(st.st_mode):
                    owners.setdefault((st.st_dev, st.st_ino), (st.st_size, set()))[1].add(venv.name)
    names = sorted({n for _, who in owners.values() for n in who})
    unique = {n: sum(size for size, who in owners.values() if who == {n}) for n in names}
    shared = sum(size for size, who in owners.values() if len(who) > 1)
    return unique, shared, sum(size for size, _ in owners.values())


def bench(buildah: Buildah) -> None:
    """The builds and the figures (see the module's docstring)."""
    names = registry("--names")
    default, other = switch_values()
    print("base image: the image tests' (debootstrap on the first run only)", file=sys.stderr)
    base = commit_base_image(buildah)

    def bud(label: str, ep: str, tag: str, target: str | None = None) -> Build:
        build = buildah.bud(tag, build_args(base, ep), f"bench-{label}", target=target)
        if build.returncode != 0:
            print(build.text()[-6000:], file=sys.stderr)
            raise BuildFailed(f"{label} failed (log: {buildah.logs}/bench-{label}.log)")
        print(f"BENCH {label} {round(build.seconds)} s", flush=True)
        return build

    bud("cold-venvs-common", MULTI_EP, "bench:venvs-common", target="venvs-common")
    for name in names:
        bud(f"cold-ep-{name}", MULTI_EP, f"bench:ep-{name}", target=f"ep-{name}")
    bud(f"cold-{MULTI_EP}", MULTI_EP, f"bench:{MULTI_EP}")
    switches = {ep: bud(f"switch-{ep}", ep, f"bench:{ep}") for ep in (default, other)}
    for ep, build in switches.items():
        print(f"CACHED switch-{ep} {build.cached_steps()} steps")
    for stage in switches[default].stages_visited():
        print(f"visited: {stage}")

    tags = [f"bench:{ep}" for ep in (MULTI_EP, default, other)]
    sizes = {tag: buildah.size(tag) for tag in tags}
    for tag, size in sizes.items():
        ratio = size / sizes[f"bench:{default}"]
        print(f"SIZE {tag} {size} bytes = {size / 1e9:.3f} GB ({ratio:.4f}x {default})")

    with buildah.mounted(f"bench:{MULTI_EP}") as root:
        unique, shared, total = venv_sharing(root / "opt" / "venvs")
    for name, size in unique.items():
        print(f"UNIQUE {name} {size} bytes = {size / 1e6:.1f} MB")
    print(f"SHARED by 2+ venvs {shared} bytes = {shared / 1e9:.3f} GB; total {total / 1e9:.3f} GB")


def bench_docker(docker: Docker) -> None:
    """The builds and figures of ``bench`` with BuildKit (see the module's docstring)."""
    names = registry("--names")
    default, other = switch_values()
    print("base image: the image tests' (debootstrap on the first run only)", file=sys.stderr)
    base = docker.import_rootfs(base_rootfs_tar(), f"ep-test-base:{recipe_key()}")

    def build(label: str, ep: str, tag: str, dockerfile: Path | None = None) -> DockerBuild:
        done = docker.build(tag, build_args(base, ep), f"bench-{label}", dockerfile=dockerfile,
                            secrets={"ca-bundle": ca_bundle()})  # fmt: skip
        if done.returncode != 0:
            print(done.text()[-6000:], file=sys.stderr)
            raise BuildFailed(f"{label} failed (log: {docker.logs}/docker-bench-{label}.log)")
        print(f"BENCH {label} {round(done.seconds)} s", flush=True)
        return done

    build(f"cold-{MULTI_EP}", MULTI_EP, f"bench:{MULTI_EP}")
    switches = {ep: build(f"switch-{ep}", ep, f"bench:{ep}") for ep in (default, other)}
    for ep, done in switches.items():
        steps = [s for s in done.steps() if s.stage != "internal"]
        cached = sum(s.status == "CACHED" for s in steps)
        print(f"CACHED switch-{ep} {cached} steps")
        ran = sorted({s.stage for s in steps if s.status == "DONE"
                      and not s.instruction.startswith("FROM ")})  # fmt: skip
        for stage in ran:
            print(f"RAN switch-{ep} {stage}")
    for stage in switches[default].stages_visited():
        print(f"visited: {stage}")
    tags = [f"bench:{ep}" for ep in (MULTI_EP, default, other)]
    sizes = {tag: docker.size(tag) for tag in tags}
    for tag, size in sizes.items():
        ratio = size / sizes[f"bench:{default}"]
        print(f"SIZE {tag} {size} bytes = {size / 1e9:.3f} GB ({ratio:.4f}x {default})")
    print(f"backends: {' '.join(names)}", file=sys.stderr)
    for ep in (MULTI_EP, default):
        ran = docker.run(f"bench:{ep}", "probes/check_env.py")
        print(f"RUN bench:{ep} probes/check_env.py exit {ran.returncode}")


def main_docker(builder: str) -> int:
    """``bench_docker`` on a dockerd of this script's own (stopped and removed at the end)."""
    try:
        engine = install(ENGINES[builder])
    except EngineUnavailable as error:
        print(f"bench_image: no Docker engine: {error}", file=sys.stderr)
        return 1
    versions = ", ".join(f"{k} {v}" for k, v in sorted(engine.versions.items()))
    print(f"ENGINE {versions}")
    try:
        with sigterm_as_ctrl_c(), running(engine, store_parent()) as daemon:
            bench_docker(Docker(daemon, None, "bench"))
    except BuildFailed as error:
        print(f"bench_image: {error}", file=sys.stderr)
        return 1
    except EngineUnavailable as error:
        print(f"bench_image: dockerd did not start: {error}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 tests/bench_image.py",
        description="The image benchmark of docs/image.md: a cold EP=all build, then EP "
        "switches on the same storage; BENCH, CACHED, SIZE (and, with buildah, UNIQUE and "
        "SHARED) lines. As root, from the repository root.",
        epilog="Environment: EP_IMAGE_TEST_STORAGE_DRIVER=overlay|vfs forces buildah's storage "
        "driver (default: overlay where the kernel mounts it, else vfs, as for the image "
        "tests); EP_IMAGE_TEST_CACHE (default /var/cache/ep-image-test) holds the base "
        "tarball, uv's download cache and the logs; EP_IMAGE_TEST_STORE_PARENT (default: "
        "that cache) is where the storage goes.",
    )
    parser.add_argument(
        "--builder",
        choices=["buildah", *ENGINES],
        default="buildah",
        help="buildah (default); docker: Docker 26 with buildx (BuildKit), from Debian 13's "
        "packages; docker-20.10: Debian 12's Docker and its built-in BuildKit",
    )
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        parser.error("run as root: the builders and debootstrap need it")
    if args.builder in ENGINES:
        if shutil.which("debootstrap") is None:
            parser.error("debootstrap not installed (python3 scripts/bootstrap.py --tests)")
        return main_docker(args.builder)
    for tool in ("buildah", "debootstrap"):
        if shutil.which(tool) is None:
            parser.error(f"{tool} not installed (python3 scripts/bootstrap.py --tests)")
    parent = store_parent()
    driver, why = storage_driver(parent)
    print(f"storage driver: {driver} ({why})", file=sys.stderr)
    buildah = Buildah(Path(tempfile.mkdtemp(prefix="bench-", dir=parent)), None, driver, "bench")
    try:
        with sigterm_as_ctrl_c():
            bench(buildah)
    except BuildFailed as error:
        print(f"bench_image: {error}", file=sys.stderr)
        return 1
    finally:
        print(f"removing buildah storage {buildah.store}", file=sys.stderr)
        buildah.remove_storage()
    return 0


if __name__ == "__main__":
    sys.exit(main())
