"""The image benchmark of docs/image.md: a cold EP=all build, EP switches, sizes and sharing.

Why: the figures docs/image.md quotes (cold EP=all, then EP switches on the same buildah storage;
each image's footprint; the bytes each backend's venv holds alone) come from this script, so
anyone can rerun them, built and measured by the image tests' own harness (tests/_buildah.py).

Run as root from the repository root, after `uv sync --group dev`:

    uv run --frozen --group dev python3 tests/bench_image.py

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
    build_args,
    commit_base_image,
    sigterm_as_ctrl_c,
    storage_driver,
    store_parent,
)

MULTI_EP = "all"


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 tests/bench_image.py",
        description="The image benchmark of docs/image.md: a cold EP=all build, then EP "
        "switches on the same buildah storage; BENCH, CACHED, SIZE, UNIQUE and SHARED lines. "
        "As root, from the repository root.",
        epilog="Environment: EP_IMAGE_TEST_STORAGE_DRIVER=overlay|vfs forces buildah's storage "
        "driver (default: overlay where the kernel mounts it, else vfs, as for the image "
        "tests); EP_IMAGE_TEST_CACHE (default /var/cache/ep-image-test) holds the base "
        "tarball, uv's download cache and the logs; EP_IMAGE_TEST_STORE_PARENT (default: "
        "that cache) is where the storage goes.",
    )
    parser.parse_args(argv)
    if os.geteuid() != 0:
        parser.error("run as root: buildah with chroot isolation and debootstrap need it")
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
