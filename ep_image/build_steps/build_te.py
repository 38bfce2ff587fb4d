#!/usr/bin/env python3
"""Source-build Transformer Engine (TE) against the cuDNN inside a uv venv, once per image or host.

Why: a TE built against any other cuDNN imports fine and fails late, in fused-attention backward.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ep_image import SOURCE_ROOT, tools
from ep_image.build_steps import lock_sync
from ep_image.build_steps.te_wheels import TE_DISTRIBUTION, TE_RECORD
from ep_image.build_steps.uv_run import BuildError, tail
from ep_image.build_steps.venv_cudnn import Cudnn, CudnnError, dist_version, find_cudnn
from ep_image.project import (
    PinError,
    VenvError,
    pinned_git,
    sha256_file,
    site_packages,
    write_json,
)

FRONTEND_DIST = "nvidia-cudnn-frontend"

# What TE's setup.py / CMake import or run besides torch, which the venv already holds.
# TE's own pyproject lists them as build requirements; with no build isolation they must be in
# the venv. Pinned here (build tools only, nothing TE links at run time); `--install-build-deps`
# installs exactly these with uv.
BUILD_REQUIREMENTS: tuple[str, ...] = (
    "cmake==3.31.10",
    "ninja==1.13.0",
    "pybind11==2.13.6",
    "wheel==0.45.1",
)


class BuildTeError(RuntimeError):
    """A problem the user can fix; the message says how."""


@dataclass(frozen=True)
class Frontend:
    """cuDNN frontend headers (header-only C++ API TE compiles against)."""

    include: Path
    version: str
    origin: str


@dataclass
class SourceCheck:
    """What the TE source tree lacks, and what this script will link in for it."""

    missing: list[str] = field(default_factory=list)
    links: dict[str, Path] = field(default_factory=dict)
    frontend: Frontend | None = None


# --- venv discovery ----------------------------------------------------------------------------


def find_frontend(venv: Path) -> Frontend | None:
    """The nvidia-cudnn-frontend wheel's headers (site-packages/include), if installed."""
    site = site_packages(venv)
    installed = dist_version(site, FRONTEND_DIST)
    header = site / "include" / "cudnn_frontend.h"
    if installed is None or not header.is_file():
        return None
    return Frontend(site / "include", installed, f"venv:{FRONTEND_DIST}")


def torch_version(venv: Path) -> str | None:
    """The venv's torch version (from dist-info: no import, so no CUDA libraries needed)."""
    return dist_version(site_packages(venv), "torch")


def missing_build_requirements(venv: Path) -> list[str]:
    """BUILD_REQUIREMENTS not installed in the venv (any version counts as installed)."""
    site = site_packages(venv)
    return [req for req in BUILD_REQUIREMENTS if dist_version(site, req.split("==")[0]) is None]


# --- TE source checks ----------------------------------------------------------------------------


def te_version(source: Path) -> str:
    """TE's version from build_tools/VERSION.txt."""
    version_file = source / "build_tools" / "VERSION.txt"
    if not (source / "setup.py").is_file() or not version_file.is_file():
        raise BuildTeError(
            f"{source} is not a TransformerEngine source tree (no setup.py or "
            "build_tools/VERSION.txt). Fix: clone it at the commit pinned in pyproject.toml "
            "[tool.uv.sources]: `git clone --recurse-submodules "
            "https://github.com/NVIDIA/TransformerEngine && git -C TransformerEngine checkout "
            "<rev> && git -C TransformerEngine submodule update --init --recursive`."
        )
    return version_file.read_text(encoding="utf-8").strip()


def nccl_ep_wanted(env: Mapping[str, str], nvte_archs: str) -> bool:
    """Mirror of TE's nccl_ep_enabled(): on by default when an arch >= 90 is targeted."""
    if env.get("NVTE_WITH_NCCL_EP", "1") == "0":
        return False
    return any(int(re.sub(r"[af]$", "", a)) >= 90 for a in nvte_archs.split(";") if a)


def check_source(source: Path, frontend: Frontend | None, need_nccl: bool) -> SourceCheck:
    """Name what TE's CMake needs from the submodules and is absent; plan frontend links."""
    third = source / "3rdparty"
    check = SourceCheck()
    fe_include = third / "cudnn-frontend" / "include"
    if (fe_include / "cudnn_frontend.h").is_file():
        check.frontend = Frontend(fe_include, frontend_header_version(fe_include), "submodule")
    elif frontend is not None:
        check.links[str(fe_include.relative_to(source))] = frontend.include
        check.frontend = frontend
    else:
        check.missing.append(
            f"3rdparty/cudnn-frontend/include (submodule; or install {FRONTEND_DIST} in the venv)"
        )
    if not (third / "cudnn-frontend" / "cmake" / "cuDNN.cmake").is_file():
        check.missing.append("3rdparty/cudnn-frontend/cmake/cuDNN.cmake (submodule)")
    if not (third / "cutlass" / "include" / "cutlass" / "cutlass.h").is_file():
        check.missing.append("3rdparty/cutlass/include (submodule)")
    if need_nccl and not (third / "nccl" / "Makefile").is_file():
        check.missing.append(
            "3rdparty/nccl (submodule; needed for NCCL EP with archs >= 9.0, "
            "or set NVTE_WITH_NCCL_EP=0)"
        )
    return check


def pinned_frontend(source: Path) -> str | None:
    """The cudnn-frontend commit TE's own tree pins (its submodule entry), if it is a git tree."""
    if not (source / ".git").exists() or shutil.which("git") is None:
        return None
    out = subprocess.run(
        ["git", "-C", str(source), "ls-tree", "HEAD", "3rdparty/cudnn-frontend"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    fields = out.stdout.split()
    return fields[2] if out.returncode == 0 and len(fields) >= 3 else None


def frontend_commit(source: Path) -> str | None:
    """HEAD of the cudnn-frontend submodule, if it is a git checkout of its own."""
    fe = source / "3rdparty" / "cudnn-frontend"
    if not (fe / ".git").exists() or shutil.which("git") is None:
        return None
    out = subprocess.run(
        ["git", "-C", str(fe), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    )
    return out.stdout.strip() or None if out.returncode == 0 else None


def frontend_note(record: Mapping[str, object]) -> str | None:
    """One line when the frontend compiled is not TE's pinned submodule (None when it is, or
    when the tree does not say what it pins)."""
    pinned, used = record.get("cudnn_frontend_pinned"), record.get("cudnn_frontend_commit")
    if not pinned or used == pinned:
        return None
    return (
        f"the cudnn-frontend compiled is {record.get('cudnn_frontend_version')} from "
        f"{record.get('cudnn_frontend_origin')} (commit {used or 'unknown'}), not the submodule "
        f"TE pins ({str(pinned)[:12]})"
    )


def frontend_header_version(include: Path) -> str:
    """cudnn-frontend version from cudnn_frontend_version.h, or 'unknown'."""
    header = include / "cudnn_frontend_version.h"
    if not header.is_file():
        return "unknown"
    text = header.read_text(encoding="utf-8", errors="replace")
    parts = [
        re.search(rf"#define CUDNN_FRONTEND_{p}_VERSION\s+(\d+)", text)
        for p in ("MAJOR", "MINOR", "PATCH")
    ]
    return ".".join(m.group(1) for m in parts) if all(parts) else "unknown"


def apply_links(source: Path, links: Mapping[str, Path]) -> None:
    """Create the planned symlinks (only where the path is absent or an empty directory)."""
    for rel, target in links.items():
        path = source / rel
        if path.is_dir() and not path.is_symlink():
            path.rmdir()  # an uninitialised submodule leaves an empty directory
        path.parent.mkdir(parents=True, exist_ok=True)
        path.symlink_to(target, target_is_directory=True)
        print(f"build_te: linked {path} -> {target}")


# --- versions and pins ---------------------------------------------------------------------------


def pinned_commit(project: Path) -> str | None:
    """The TE commit pinned in pyproject.toml [tool.uv.sources] (the one source of truth)."""
    try:
        return pinned_git(project, TE_DISTRIBUTION)[1]
    except PinError:
        return None


def source_commit(source: Path) -> str | None:
    """HEAD of the TE source if it is a git work tree, else None (a plain snapshot)."""
    if not (source / ".git").exists() or shutil.which("git") is None:
        return None
    result = subprocess.run(
        ["git", "-C", str(source), "rev-parse", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        return None
    return result.stdout.strip() or None


def nvcc_binary(env: Mapping[str, str]) -> Path:
    """nvcc the way TE finds it: $CUDA_HOME/bin/nvcc, else PATH, else /usr/local/cuda."""
    if env.get("CUDA_HOME"):
        return Path(env["CUDA_HOME"]) / "bin" / "nvcc"
    found = shutil.which("nvcc", path=env.get("PATH"))
    return Path(found) if found else Path("/usr/local/cuda/bin/nvcc")


def cuda_version(env: Mapping[str, str]) -> str:
    """CUDA release from `nvcc --version` (what TE's build_tools.utils.cuda_version reads)."""
    nvcc = nvcc_binary(env)
    if not nvcc.is_file():
        raise BuildTeError(
            f"nvcc not found at {nvcc}: TE compiles CUDA code. Fix: build in a CUDA devel "
            "image or set CUDA_HOME to a CUDA 13 toolkit."
        )
    out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=True)
    match = re.search(r"release\s+([\d.]+)", out.stdout)
    return match.group(1) if match else "unknown"


def nvte_archs(arch_list: str) -> str:
    """'9.0;10.0' (TORCH_CUDA_ARCH_LIST style) -> '90;100' (NVTE_CUDA_ARCHS / CMake style)."""
    out = []
    for arch in re.split(r"[;\s]+", arch_list.strip()):
        match = re.fullmatch(r"(\d+)\.(\d)([af]?)", arch)
        if match is None:
            raise BuildTeError(
                f"bad architecture {arch!r} in --arch-list {arch_list!r}. "
                'Fix: use compute capabilities like "9.0;10.0" (Hopper; Blackwell).'
            )
        out.append("".join(match.groups()))
    return ";".join(out)


# --- the build -----------------------------------------------------------------------------------


def build_env(
    base: Mapping[str, str], venv: Path, cudnn: Cudnn, arch_list: str, jobs: int, threads: int
) -> dict[str, str]:
    """The variables TE's setup.py/CMake read, pointing every cuDNN lookup at the venv."""

    def prepend(name: str, *values: Path) -> str:
        return os.pathsep.join([*map(str, values), *filter(None, [base.get(name)])])

    # TE's util/logging.h includes nccl.h even with NCCL EP off: the lock's NCCL headers, the
    # NCCL the venv loads at run time.
    nccl = site_packages(venv) / "nvidia" / "nccl" / "include"
    includes = [cudnn.include, *([nccl] if (nccl / "nccl.h").is_file() else [])]
    return {
        # cudnn-frontend's cuDNN.cmake searches these before the CUDA toolkit and system paths.
        "CUDNN_PATH": str(cudnn.root),
        "CUDNN_HOME": str(cudnn.root),
        "CUDNN_INCLUDE_PATH": str(cudnn.include),
        "CUDNN_LIBRARY_PATH": str(cudnn.lib),
        # Compiler/linker search order: the venv's cuDNN ahead of any /usr/include copy.
        "CPATH": prepend("CPATH", *includes),
        "LIBRARY_PATH": prepend("LIBRARY_PATH", cudnn.lib),
        "LD_LIBRARY_PATH": prepend("LD_LIBRARY_PATH", cudnn.lib),
        # cmake and ninja from the venv (TE's found_ninja() looks on PATH).
        "PATH": prepend("PATH", venv / "bin"),
        "VIRTUAL_ENV": str(venv),
        "NVTE_FRAMEWORK": "pytorch",
        # check_source has checked the submodules TE's CMake reads and linked in the frontend;
        # TE's own git check would refuse that link and a snapshot without .gitmodules state.
        "NVTE_SKIP_SUBMODULE_CHECKS_DURING_BUILD": "1",
        "NVTE_CUDA_ARCHS": nvte_archs(arch_list),
        "TORCH_CUDA_ARCH_LIST": arch_list,
        "MAX_JOBS": str(jobs),
        "NVTE_BUILD_THREADS_PER_JOB": str(threads),
    }


def build_command(uv: str, venv: Path, source: Path, out: Path) -> list[str]:
    """`uv build` with the venv's interpreter and no isolation (TE's documented uv recipe)."""
    return [
        uv,
        "build",
        "--wheel",
        "--no-build-isolation",
        "--python",
        str(venv / "bin" / "python"),
        "--out-dir",
        str(out),
        str(source),
    ]


def install_build_requirements(uv: str, venv: Path) -> None:
    """Install BUILD_REQUIREMENTS into the venv (pinned, from the registry)."""
    cmd = [uv, "pip", "install", "--python", str(venv / "bin" / "python"), *BUILD_REQUIREMENTS]
    print("build_te: " + shlex.join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def write_record(out: Path, record: Mapping[str, object]) -> Path:
    """Write te-build.json into OUT (atomically, world-readable)."""
    return write_json(out / TE_RECORD, record)


def now() -> str:
    """UTC timestamp for records."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- inputs made on the fly: a venv from the lock, a clone of the pinned commit ------------------


def run_logged(cmd: Sequence[str], **kw: object) -> None:
    """Run a command, printing it first; its output streams to ours."""
    print("build_te: " + shlex.join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)  # type: ignore[call-overload]


def make_build_venv(uv: str, venv: Path, project: Path) -> Path:
    """The environment TE compiles against: the lock's ``moe`` extra without TE itself, made by
    the same steps as the backend venvs (no bytecode: it lives only for this build)."""
    try:
        python = os.environ.get("UV_PYTHON")
        lock_sync.create_venv(uv, venv, python, project, relocatable=False)
        env = {**lock_sync.sync_environment(venv), "UV_COMPILE_BYTECODE": "0"}
        lock_sync.sync(uv, venv, project, ["moe"], [TE_DISTRIBUTION], env=env)
    except BuildError as exc:
        raise BuildTeError(
            f"making the build venv from {project / 'uv.lock'} failed (output above). Fix what "
            f"uv's error names; it ends:\n{tail(str(exc))}"
        ) from None
    return venv


def clone_pinned(project: Path, dest: Path) -> Path:
    """Clone the TE URL + commit pinned in pyproject.toml, submodules included.

    git applies the git config's ``url.<mirror>.insteadOf`` rules (the image passes them as the
    ``gitconfig`` secret), so an air-gapped build clones from its mirror.
    """
    try:
        url, rev = pinned_git(project, TE_DISTRIBUTION)
    except PinError as exc:
        raise BuildTeError(str(exc)) from None
    print(f"build_te: cloning {url} at {rev} (pinned in pyproject.toml)", flush=True)
    try:
        run_logged(["git", "clone", "--quiet", url, str(dest)])
        run_logged(["git", "-C", str(dest), "checkout", "--quiet", rev])
        run_logged(["git", "-C", str(dest), "submodule", "update", "--init", "--recursive"])
    except subprocess.CalledProcessError:
        raise BuildTeError(
            f"cloning {url} at {rev} failed (output above). Fix: give the build access to "
            "github.com, or point git at a mirror that holds the commit and TE's submodules: "
            f"`git config --global url.<mirror>.insteadOf {url}` (image builds: the gitconfig "
            "secret, docs/image.md), or pass --source with a checkout."
        ) from None
    return dest


@contextlib.contextmanager
def build_inputs(args: argparse.Namespace) -> Iterator[tuple[Path, Path]]:
    """(venv, source) for the build: the given ones, or temporary ones removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="build-te-") as tmp:
        venv = args.venv
        if venv is None:
            venv = make_build_venv(args.uv, Path(tmp) / "venv", args.project.resolve())
        source = args.source
        clone = source is None or (args.clone_unless_source and not (source / "setup.py").is_file())
        if clone:
            source = clone_pinned(args.project.resolve(), Path(tmp) / "TransformerEngine")
        yield venv, source


def mode_arg(value: str) -> str:
    """--mode / the image's TE_BUILD: build or skip."""
    if value not in ("build", "skip"):
        raise argparse.ArgumentTypeError(
            f"must be 'build' or 'skip' (the image's TE_BUILD), got {value!r}"
        )
    return value


# --- CLI -----------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=(
            "Build a Transformer Engine wheel from source against the cuDNN installed in VENV "
            f"(its nvidia-cudnn-cu13 wheel) and record that cuDNN in OUT/{TE_RECORD}."
        ),
        epilog=(
            "example: python3 -m ep_image.build_steps.build_te --venv .venv "
            "--source ../TransformerEngine "
            '--arch-list "9.0;10.0" --jobs 8 --out dist/te'
        ),
    )
    parser.add_argument(
        "--mode",
        type=mode_arg,
        default="build",
        help="build (default) or skip: record that TE was not built (the image's TE_BUILD)",
    )
    parser.add_argument(
        "--venv",
        type=Path,
        help="venv made by `uv sync --extra moe ...` (default: a throwaway one from the lock)",
    )
    parser.add_argument(
        "--source",
        type=Path,
        help="TransformerEngine source tree (default: a clone of the commit pyproject.toml pins)",
    )
    parser.add_argument(
        "--clone-unless-source",
        action="store_true",
        help="clone the pinned commit when --source holds no setup.py (the image's TE_SOURCE)",
    )
    parser.add_argument(
        "--arch-list",
        default="9.0;10.0",
        help='CUDA compute capabilities, TORCH_CUDA_ARCH_LIST style (default "9.0;10.0")',
    )
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="MAX_JOBS")
    parser.add_argument(
        "--threads-per-job", type=int, default=1, help="NVTE_BUILD_THREADS_PER_JOB (default 1)"
    )
    parser.add_argument("--out", type=Path, required=True, help="where the wheel and json go")
    parser.add_argument(
        "--project",
        type=Path,
        default=SOURCE_ROOT,
        help="project whose pyproject.toml pins the TE commit (default: this repo)",
    )
    parser.add_argument("--uv", help="uv executable (default: uv on PATH, or bootstrap.py's)")
    parser.add_argument(
        "--install-build-deps",
        action="store_true",
        help="first install " + " ".join(BUILD_REQUIREMENTS) + " into VENV with uv",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the environment and command, build nothing"
    )
    parser.add_argument(
        "--skip",
        metavar="REASON",
        help=f"build nothing; write {TE_RECORD} saying TE was skipped and why",
    )
    args = parser.parse_args(argv)
    if args.mode == "skip" and args.skip is None:
        args.skip = "--mode skip (the image's TE_BUILD=skip): CPU-only image, TE not built"
    if args.dry_run and (args.venv is None or args.source is None):
        parser.error("--dry-run needs --venv and --source")
    if args.jobs < 1 or args.threads_per_job < 1:
        parser.error("--jobs and --threads-per-job must be >= 1")
    return args


def skip_record(args: argparse.Namespace) -> dict[str, object]:
    """te-build.json for an image built without TE (what is known without building)."""
    record: dict[str, object] = {
        "skipped": True,
        "reason": args.skip,
        "te_version": None,
        "te_commit_pinned": pinned_commit(args.project),
        "arch_list": args.arch_list,
        "recorded_at": now(),
    }
    if args.venv is not None:
        cudnn = find_cudnn(args.venv)
        record.update(cudnn_version=cudnn.version, cudnn_include=str(cudnn.include))
        record.update(cudnn_lib=str(cudnn.lib))
    return record


def plan(
    args: argparse.Namespace, venv: Path, source: Path
) -> tuple[dict[str, str], list[str], dict[str, object]]:
    """Everything discovered before building: env overrides, command, partial record."""
    venv, source = venv.resolve(), source.resolve()
    cudnn = find_cudnn(venv)
    version = te_version(source)
    env = build_env(os.environ, venv, cudnn, args.arch_list, args.jobs, args.threads_per_job)
    check = check_source(
        source, find_frontend(venv), nccl_ep_wanted(os.environ, env["NVTE_CUDA_ARCHS"])
    )
    cmd = build_command(args.uv, venv, source, args.out.resolve())
    pinned, head = pinned_commit(args.project), source_commit(source)
    record: dict[str, object] = {
        "skipped": False,
        "te_version": version,
        "te_commit": head or pinned,
        "te_commit_pinned": pinned,
        "te_commit_source": head,
        "cudnn_version": cudnn.version,
        "cudnn_dist_version": cudnn.dist_version,
        "cudnn_include": str(cudnn.include),
        "cudnn_lib": str(cudnn.lib),
        "cudnn_frontend_version": check.frontend.version if check.frontend else None,
        "cudnn_frontend_origin": check.frontend.origin if check.frontend else None,
        "cudnn_frontend_commit": frontend_commit(source),
        "cudnn_frontend_pinned": pinned_frontend(source),
        "nccl_ep": nccl_ep_wanted(os.environ, env["NVTE_CUDA_ARCHS"]),
        "arch_list": args.arch_list,
        "nvte_cuda_archs": env["NVTE_CUDA_ARCHS"],
        "torch_version": torch_version(venv),
        "build_requirements_missing": missing_build_requirements(venv),
        "max_jobs": args.jobs,
        "source_missing": check.missing,
        "source_links": {k: str(v) for k, v in check.links.items()},
    }
    return env, cmd, record


def print_plan(env: Mapping[str, str], cmd: Sequence[str], record: Mapping[str, object]) -> None:
    """Shell-pasteable environment and command, then what the source check found."""
    print("# build_te: environment (exported on top of the current one)")
    for key in sorted(env):
        print(f"export {key}={shlex.quote(env[key])}")
    print("# build_te: command")
    print(shlex.join(cmd))
    print(f"# cudnn {record['cudnn_version']} from {record['cudnn_include']}")
    for rel, target in dict(record["source_links"]).items():  # type: ignore[call-overload]
        print(f"# will link {rel} -> {target}")
    for item in list(record["source_missing"]):  # type: ignore[call-overload]
        print(f"# MISSING in source: {item}")
    if note := frontend_note(record):
        print(f"# NOTE: {note}")
    if record["torch_version"] is None:
        print("# MISSING in venv: torch (TE's PyTorch extension compiles against it)")
    for req in list(record["build_requirements_missing"]):  # type: ignore[call-overload]
        print(f"# MISSING in venv: {req} (installed by --install-build-deps)")


def check_pins(record: Mapping[str, object]) -> None:
    """Refuse to build a TE commit other than the pinned one (two pins must not drift)."""
    pinned, head = record["te_commit_pinned"], record["te_commit_source"]
    if pinned and head and pinned != head:
        raise BuildTeError(
            f"TE source is at {head} but pyproject.toml pins {pinned}. Fix: "
            f"`git -C SOURCE checkout {pinned} && git -C SOURCE submodule update --init "
            "--recursive`, or change the pin in pyproject.toml."
        )


def build(
    args: argparse.Namespace, venv: Path, source: Path, plan_: tuple[dict, list, dict]
) -> Path:
    """Run the build and write te-build.json; return the wheel."""
    env, cmd, record = plan_
    if record["source_missing"]:
        raise BuildTeError(
            "the TE source tree lacks: "
            + "; ".join(record["source_missing"])
            + ". Fix: `git -C SOURCE submodule update --init --recursive` (needs network to "
            "GitHub), or copy those submodules in at the commits TE pins."
        )
    check_pins(record)
    if record["torch_version"] is None:
        raise BuildTeError(
            f"torch is not installed in {venv}; TE's PyTorch extension compiles against "
            "it. Fix: `uv sync --frozen --extra moe --no-install-package transformer-engine`."
        )
    if args.install_build_deps:
        install_build_requirements(args.uv, venv.resolve())
    missing = record["build_requirements_missing"] = missing_build_requirements(venv.resolve())
    if missing:
        raise BuildTeError(
            f"TE's build tools are missing from the venv: {' '.join(missing)}. Fix: rerun "
            "with --install-build-deps, or `uv pip install --python VENV/bin/python "
            f"{' '.join(missing)}`."
        )
    full_env = {**os.environ, **env}
    record["cuda_version"] = cuda_version(full_env)
    if note := frontend_note(record):
        print(f"build_te: note: {note}", flush=True)
    apply_links(source.resolve(), {k: Path(v) for k, v in record["source_links"].items()})
    args.out.mkdir(parents=True, exist_ok=True)
    before = set(args.out.glob("transformer_engine-*.whl"))
    started = time.monotonic()
    result = subprocess.run(cmd, env=full_env, check=False)
    if result.returncode != 0:
        raise BuildTeError(
            f"the TE build failed (exit {result.returncode}); its output is above. With few "
            "cores or little memory, lower --jobs (MAX_JOBS)."
        )
    wheels = sorted(set(args.out.glob("transformer_engine-*.whl")) - before)
    if len(wheels) != 1:
        raise BuildTeError(f"expected one new transformer_engine wheel in {args.out}, got {wheels}")
    record.update(
        wheel=wheels[0].name,
        wheel_sha256=sha256_file(wheels[0]),
        build_seconds=round(time.monotonic() - started, 1),
        built_at=now(),
        python=str(venv / "bin" / "python"),
    )
    write_record(args.out, record)
    return wheels[0]


def main(argv: Sequence[str] | None = None) -> int:
    """Build TE against the exact cuDNN the lock installs (the venv's ``nvidia-cudnn-cu13``,
    not the base image's copy; the image then loads that same cuDNN first, stage_cudnn.py):

    1. find that cuDNN in the venv (``site-packages/nvidia/cudnn/{include,lib}``) and read its
       version from ``cudnn_version.h`` (ep_image/build_steps/venv_cudnn.py);
    2. check that the TE source tree holds what TE's CMake needs (its git submodules are missing
       from plain snapshots) and, where only the cuDNN frontend headers are missing, point TE at
       the ``nvidia-cudnn-frontend`` wheel the lock pins;
    3. build the wheel with the venv's own Python and no build isolation (TE's torch extension
       must compile against the venv's torch), with the environment variables TE's build reads
       (``CUDNN_PATH``/``CUDNN_HOME``, ``NVTE_FRAMEWORK``, ``NVTE_CUDA_ARCHS``, ``MAX_JOBS``,
       ``NVTE_BUILD_THREADS_PER_JOB``);
    4. write ``te-build.json`` beside the wheel, so probes and the image can compare the cuDNN
       TE was built against with the one that is loaded.

    ``--dry-run`` prints the exact environment and command and exits 0. ``--skip REASON`` (or
    ``--mode skip``) writes a ``te-build.json`` that records that TE was not built (CPU-only
    test images). Host mode and the image's ``te`` stage run this same command. Without
    ``--venv`` it makes a throwaway venv from the lock (the ``moe`` extra without
    transformer-engine, ep_image/build_steps/lock_sync.py); without a TE checkout (``--source``
    omitted, or ``--clone-unless-source`` and a directory without setup.py, as the image's
    default TE_SOURCE) it clones the git URL and commit pyproject.toml pins, through any
    ``url.<mirror>.insteadOf`` of the git config. Both are deleted when the build ends. Only
    the standard library is used (plus ep_image): this runs before anything else exists in an
    image. Exit codes: 0 built (or skipped, or a dry run); 1 an error that names its fix.
    """
    args = parse_args(argv)
    try:
        if args.skip is not None:
            path = write_record(args.out, skip_record(args))
            print(f"build_te: TE build skipped ({args.skip}); recorded in {path}")
            return 0
        if args.uv is None:  # by name when on PATH: the printed commands stay pasteable
            args.uv = "uv" if shutil.which("uv") else tools.find_uv()
        if args.dry_run:
            print_plan(*plan(args, args.venv, args.source))
            return 0
        with build_inputs(args) as (venv, source):
            planned = plan(args, venv, source)
            record = planned[2]
            wheel = build(args, venv, source, planned)
    except (BuildTeError, CudnnError, VenvError, tools.ToolError) as err:
        print(f"build_te: error: {err}", file=sys.stderr)
        return 1
    print(f"build_te: built {wheel} against cuDNN {record['cudnn_version']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
