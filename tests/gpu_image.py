"""Build the full image (nothing left out) and export its root file system for a GPU machine.

Why: the image tests build a CPU profile (TE skipped, big CUDA libraries and the git-sourced
backends left out); what users run is the full image. This builds docker/Dockerfile as a user's
CI would, from a local stand-in for the NGC devel base (tests/_ngc_standin.py): TE compiled from
source in its stage, DeepEP v1 and HybridEP compiled from their pinned commits, cloned through
the ``gitconfig`` secret from git mirrors that ``git daemon`` serves on 127.0.0.1. Then it
exports the image's root file system in parts a GPU machine can take one at a time.

As root, from the repository root, after ``uv sync --group dev``:

    uv run --frozen --group dev python3 tests/gpu_image.py build --ep all \\
        --te-source .src/TransformerEngine --mirror DeepEP=/path/DeepEP.git \\
        --mirror nccl=/path/nccl.git
    uv run --frozen --group dev python3 tests/gpu_image.py export --ep all --out DIR

``build`` keeps its buildah storage (EP_IMAGE_TEST_CACHE/gpu-image, default
/var/cache/ep-image-test/gpu-image), so a later build reuses every stage its inputs leave
unchanged. It prints ``STAGE <name> <seconds> s`` for each stage (from buildah's log) and
``IMAGE <name> <id> <bytes>``. ``export`` writes DIR/rootfs.tar.zst.NNN parts (59 MiB each),
DIR/SHA256SUMS (the parts), DIR/manifest.sha256.zst (``sha256sum`` lines of every regular file
of the root file system, to verify the copy where it lands) and DIR/image.json (the image's
name, id, EP, config (ENV, WORKDIR, ENTRYPOINT: what a runtime applies), the lock's sha256, the
commit the build context was at, sizes). The tar lists files by
size, so the copies of one file (the CUDA home's math libraries and the venvs') sit next to
each other and zstd's long window stores them once.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from _buildah import CACHE, Buildah, ca_bundle, sigterm_as_ctrl_c, storage_driver
from _ngc_standin import standin_image

ROOT = Path(__file__).resolve().parents[1]
STORE = CACHE / "gpu-image"
#: The export's part size: 59 MiB, so that a part and the repository travel together in 64 MiB.
PART_BYTES = 59 * 1024 * 1024
GITHUB = {
    "DeepEP": "https://github.com/deepseek-ai/DeepEP",
    "nccl": "https://github.com/NVIDIA/nccl",
}


def buildah_here() -> Buildah:
    STORE.mkdir(parents=True, exist_ok=True)
    (STORE / "tmp" / "buildah-cache").unlink(missing_ok=True)  # Buildah links it anew
    driver_file = STORE / "driver"
    if not driver_file.is_file():
        driver_file.write_text(storage_driver(STORE)[0])
    return Buildah(STORE, None, driver_file.read_text().strip(), "gpu image")


@contextlib.contextmanager
def git_daemon(mirrors: dict[str, Path]) -> Iterator[Path]:
    """Serve each bare mirror as git://127.0.0.1:PORT/<name>.git; yield a gitconfig whose
    insteadOf rules send GitHub's URLs there."""
    served = STORE / "mirrors"
    served.mkdir(exist_ok=True)
    for name, path in mirrors.items():
        link = served / f"{name}.git"
        link.unlink(missing_ok=True)
        link.symlink_to(path.resolve())
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    daemon = subprocess.Popen(
        [
            "git",
            "daemon",
            "--export-all",
            "--reuseaddr",
            "--listen=127.0.0.1",
            f"--port={port}",
            f"--base-path={served}",
            str(served),
        ]
    )
    config = STORE / "gitconfig"
    # The URL as the lock spells it and as a submodule's .gitmodules does (with .git); git
    # takes the longest prefix that matches.
    config.write_text(
        "".join(
            f'[url "git://127.0.0.1:{port}/{name}.git"]\n'
            f"\tinsteadOf = {GITHUB[name]}\n\tinsteadOf = {GITHUB[name]}.git\n"
            for name in mirrors
        )
    )
    try:
        time.sleep(1)
        yield config
    finally:
        daemon.terminate()
        daemon.wait(timeout=10)


def stage_times(log: list[str]) -> dict[str, float]:
    """Seconds from each stage's first step to the next stage's, from the timed log lines."""
    marks = []
    for line in log:
        found = re.match(r"\[\s*([\d.]+)s\] .*STEP 1/\d+: FROM \S+(?: AS (\S+))?", line)
        if found:
            marks.append((found[2] or "final", float(found[1])))
    ends = [t for _, t in marks[1:]] + [None]
    return {
        name: (end - start if end is not None else -1.0)
        for (name, start), end in zip(marks, ends, strict=True)
    }


def context_state() -> dict[str, object]:
    """The commit the build context is at, and whether what the image is built from differs
    from it (uncommitted changes under the paths the Dockerfile copies)."""
    git = ["git", "-C", str(ROOT)]
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True)
    paths = ["ep_image", "probes", "scripts", "docker", "pyproject.toml", "uv.lock"]
    status = subprocess.run(
        [*git, "status", "--porcelain", "--", *paths], capture_output=True, text=True
    )
    return {"commit": commit.stdout.strip(), "context_dirty": bool(status.stdout.strip())}


def build(args: argparse.Namespace) -> int:
    buildah = buildah_here()
    base = args.base or standin_image(buildah)
    if args.base and buildah("images", "--quiet", args.base, check=False).returncode != 0:
        print(
            f"--base {args.base}: no such image in {STORE}; load or pull it there first",
            file=sys.stderr,
        )
        return 2
    print(f"base: {base}", flush=True)
    build_args = {
        "BASE_IMAGE": base,
        "EP": args.ep,
        "TE_BUILD": "build",
        "TORCH_CUDA_ARCH_LIST": args.arch_list,
        "MAX_JOBS": str(args.jobs),
        "NVTE_WITH_NCCL_EP": "0",
        "VENV_SKIP_PACKAGES": "",
    }
    if args.te_source:
        build_args["TE_SOURCE"] = args.te_source
    if args.prebuilt_wheels:
        build_args["PREBUILT_WHEELS"] = args.prebuilt_wheels
    mirrors = dict(m.split("=", 1) for m in args.mirror)
    tag = f"localhost/ep-image:{args.ep}"
    context = context_state()
    with git_daemon({k: Path(v) for k, v in mirrors.items()}) as gitconfig:
        result = buildah.bud(
            tag, build_args, f"gpu-image-{args.ep}", secrets={"gitconfig": gitconfig}
        )
    timed = (buildah.logs / f"gpu-image-{args.ep}.log").read_text().splitlines()
    stages = stage_times(timed)
    for name, seconds in stages.items():
        print(f"STAGE {name} {seconds:.0f} s")
    print(f"BUILD {args.ep} rc={result.returncode} {result.seconds:.0f} s")
    if result.returncode != 0:
        print("\n".join(result.log[-60:]), file=sys.stderr)
        return 1
    image_id = json.loads(buildah("inspect", tag).stdout)["FromImageID"]
    print(f"IMAGE {tag} {image_id} {buildah.size(tag)}")
    record = {
        "image": tag,
        "image_id": image_id,
        "build_args": build_args,
        **context,
        "build_seconds": round(result.seconds),
        "stage_seconds": stages,
    }
    (STORE / f"build-{args.ep}.json").write_text(json.dumps(record, indent=2) + "\n")
    return 0


def walk(rootfs: Path) -> list[tuple[int, str]]:
    """(size, path) of every entry but directories, symlinks to directories included."""
    files = []
    for dirpath, dirs, names in os.walk(rootfs):
        dirs.sort()
        links = [d for d in dirs if (Path(dirpath) / d).is_symlink()]  # not walked into
        for name in sorted(names + links):
            st = (Path(dirpath) / name).lstat()
            size = st.st_size if stat.S_ISREG(st.st_mode) else 0
            files.append((size, str((Path(dirpath) / name).relative_to(rootfs))))
    return sorted(files)


def manifest_lines(rootfs: Path, files: list[tuple[int, str]]) -> list[str]:
    """``sha256sum`` lines of every regular file (hardlinked files read once)."""
    lines, digests = [], {}
    for _size, rel in files:
        st = (rootfs / rel).lstat()
        if stat.S_ISREG(st.st_mode):
            key = (st.st_dev, st.st_ino)
            if key not in digests:
                digests[key] = hashlib.sha256((rootfs / rel).read_bytes()).hexdigest()
            lines.append(f"{digests[key]}  ./{rel}\n")
    return lines


def export(args: argparse.Namespace) -> int:
    buildah = buildah_here()
    tag = args.image or f"localhost/ep-image:{args.ep}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    inspected = json.loads(buildah("inspect", tag).stdout)
    image_id, config = inspected["FromImageID"], inspected["OCIv1"].get("config", {})
    with buildah.mounted(tag) as rootfs:
        files = walk(rootfs)
        manifest = manifest_lines(rootfs, files)
        subprocess.run(
            ["zstd", "-q", "-19", "-f", "-o", str(out / "manifest.sha256.zst")],
            input="".join(manifest).encode(),
            check=True,
        )
        image_lock = rootfs / "opt/ep-image/uv.lock"
        lock = hashlib.sha256(image_lock.read_bytes()).hexdigest() if image_lock.is_file() else None
        listing = out / "files.txt"
        listing.write_text("".join(f"./{rel}\n" for _, rel in files))
        # Directories first (their modes and owners), then every file by size.
        script = (
            f"set -o pipefail; tar -C {rootfs} --numeric-owner --no-recursion -cf - "
            f"--files-from <(cd {rootfs} && find . -type d | sort) --files-from {listing} "
            f"| zstd -{args.level} -T0 --long=31 -q -c "
            f"| split -b {PART_BYTES} -d -a 3 - {out}/rootfs.tar.zst."
        )
        if subprocess.run(["bash", "-c", script]).returncode != 0:
            return 1
    parts = sorted(out.glob("rootfs.tar.zst.*"))
    (out / "SHA256SUMS").write_text(
        "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n" for p in parts)
    )
    built = STORE / f"build-{args.ep}.json"
    record = {
        "image": tag,
        "image_id": image_id,
        "ep": args.ep,
        "uv_lock_sha256": lock,
        "config": {k: config.get(k) for k in ("Env", "WorkingDir", "Entrypoint", "Cmd")},
        "build": json.loads(built.read_text()) if built.is_file() and not args.image else None,
        "image_bytes": buildah.size(tag),
        "files": len(manifest),
        "parts": len(parts),
        "export_bytes": sum(p.stat().st_size for p in parts),
    }
    (out / "image.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 tests/gpu_image.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build the full image from the NGC stand-in")
    b.add_argument("--ep", default="all")
    b.add_argument("--te-source", help="a TE checkout inside the build context (TE_SOURCE)")
    b.add_argument(
        "--mirror",
        action="append",
        default=[],
        metavar="NAME=BARE_REPO",
        help=f"a bare git mirror to serve, NAME one of {sorted(GITHUB)}",
    )
    b.add_argument(
        "--base",
        help="build FROM this image in the harness's storage (a loaded NGC image, an earlier "
        "stand-in) instead of the stand-in the current recipe makes",
    )
    b.add_argument(
        "--prebuilt-wheels",
        metavar="DIR",
        help="a directory inside the build context (PREBUILT_WHEELS) of wheels built earlier by "
        "the same steps (a TE wheel and its te-build.json from scripts/build_te.py --out): a "
        "stage whose record matches takes its wheel instead of compiling",
    )
    b.add_argument("--arch-list", default="9.0")
    b.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    e = sub.add_parser("export", help="export the image's root file system in parts")
    e.add_argument("--ep", default="all")
    e.add_argument("--out", required=True)
    e.add_argument("--level", type=int, default=12)
    e.add_argument("--image", help="export this image instead of the one --ep names")
    args = parser.parse_args(argv)
    if os.geteuid() != 0 or shutil.which("buildah") is None:
        parser.error("run as root with buildah installed (scripts/bootstrap.py --tests)")
    print(f"CA bundle secret: {ca_bundle()}", file=sys.stderr)
    with sigterm_as_ctrl_c():
        return build(args) if args.command == "build" else export(args)


if __name__ == "__main__":
    sys.exit(main())
