"""Source-build Transformer Engine (TE) against the cuDNN inside a uv venv, once per image or host:
the command, the plan it prints or builds, and te-build.json.

Why: a TE built against any other cuDNN imports fine and fails late, in fused-attention backward.
The source tree's checks are in ``source``, the build venv and environment in ``environment``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from ep_image import SOURCE_ROOT, cli
from ep_image.build_steps._source_builds import prebuilt
from ep_image.build_steps._te_wheels import TE_RECORD
from ep_image.build_steps._uv import pinned, trust_store
from ep_image.build_steps._venv.cudnn import CudnnError, find_cudnn
from ep_image.build_steps._venv.layout import VenvError
from ep_image.build_steps.build_te.environment import (
    BUILD_REQUIREMENTS,
    build_command,
    build_env,
    cuda_version,
    install_build_requirements,
    make_build_venv,
    missing_build_requirements,
    nvte_archs,
    torch_version,
)
from ep_image.build_steps.build_te.source import (
    BuildTeError,
    apply_links,
    check_pins,
    check_source,
    clone_pinned,
    find_frontend,
    frontend_commit,
    frontend_note,
    nccl_ep_wanted,
    pinned_commit,
    pinned_frontend,
    source_commit,
    te_version,
)
from ep_image.files.records import not_a_file, sha256_file, write_json
from ep_image.pins import locked_versions

PROG = "build_te"


def write_record(out: Path, record: Mapping[str, object]) -> Path:
    """Write te-build.json into OUT (atomically, world-readable)."""
    return write_json(out / TE_RECORD, record)


def now() -> str:
    """UTC timestamp for records."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def prebuilt_expected(args: argparse.Namespace) -> dict[str, object]:
    """What a prebuilt TE wheel's te-build.json must say to stand in for this build: the pinned
    commit, the lock's torch, cuDNN and frontend, the arch list, nvcc's CUDA release and
    whether NCCL EP is compiled in."""
    project = args.project.resolve()

    def locked(name: str) -> str | None:
        versions = sorted(locked_versions(project, name))
        return versions[0] if len(versions) == 1 else " | ".join(versions) or None

    archs = prebuilt.arch_list_key(args.arch_list)
    return {
        "skipped": False,
        "te_commit": pinned_commit(project),
        "torch_version": locked("torch"),
        "cudnn_dist_version": locked("nvidia-cudnn-cu13"),
        "cudnn_frontend_version": locked("nvidia-cudnn-frontend"),
        "arch_list": archs,
        "cuda_version": cuda_version(os.environ),
        "nccl_ep": nccl_ep_wanted(os.environ, nvte_archs(archs or "")),
    }


def take_prebuilt(args: argparse.Namespace) -> Path | None:
    """The prebuilt wheel from ``--prebuilt`` copied into ``--out`` with its record, when that
    record matches this build; None (after saying why) when none does."""
    choice = prebuilt.choose(args.prebuilt, [TE_RECORD], prebuilt_expected(args))
    print(choice.say(PROG, "Transformer Engine", args.prebuilt), flush=True)
    if choice.wheel is None:
        return None
    args.out.mkdir(parents=True, exist_ok=True)
    for source in (choice.wheel, args.prebuilt / TE_RECORD):
        partial = args.out / f".{source.name}.partial"
        shutil.copyfile(source, partial)
        partial.replace(args.out / source.name)
    return args.out / choice.wheel.name


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


def skip_record(args: argparse.Namespace) -> dict[str, object]:
    """te-build.json for an image built without TE (what is known without building)."""
    record: dict[str, object] = {
        "skipped": True,
        "reason": args.skip,
        "te_version": None,
        "te_commit_pinned": pinned_commit(args.project),
        "arch_list": prebuilt.arch_list_key(args.arch_list),
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
        "arch_list": prebuilt.arch_list_key(args.arch_list),
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


# --- CLI -----------------------------------------------------------------------------------------


def mode_arg(value: str) -> str:
    """--mode / the image's TE_BUILD: build or skip."""
    if value not in ("build", "skip"):
        raise argparse.ArgumentTypeError(
            f"must be 'build' or 'skip' (the image's TE_BUILD), got {value!r}"
        )
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.Parser(
        prog=PROG,
        description=(
            "Build a Transformer Engine wheel from source against the cuDNN installed in VENV "
            f"(its nvidia-cudnn-cu13 wheel) and record that cuDNN in OUT/{TE_RECORD}."
        ),
        epilog=(
            "Exit codes: 0 built (or skipped, or a dry run); 1 an error that names its fix; "
            "2 bad usage. Example: python3 -m ep_image.build_steps.build_te --venv .venv "
            '--source ../TransformerEngine --arch-list "9.0;10.0" --jobs 8 --out dist/te'
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
        "--prebuilt",
        type=Path,
        metavar="DIR",
        help=(
            f"take the TE wheel in DIR instead of building, when the {TE_RECORD} beside it "
            "matches this build (pinned commit, the lock's torch, cuDNN and frontend, "
            "--arch-list, nvcc's CUDA, NCCL EP); else build, saying which field differs"
        ),
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
    if (why := not_a_file(args.out / TE_RECORD)) is not None:
        parser.error(f"--out: {why}, where the record goes: remove it or give another --out")
    return args


def run(args: argparse.Namespace) -> int:
    """Build TE against the exact cuDNN the lock installs (the venv's ``nvidia-cudnn-cu13``,
    not the base image's copy; the image then loads that same cuDNN first, stage_cudnn.py):

    1. find that cuDNN in the venv (``site-packages/nvidia/cudnn/{include,lib}``) and read its
       version from ``cudnn_version.h`` (ep_image/build_steps/_venv/cudnn.py);
    2. check that the TE source tree holds what TE's CMake needs (its git submodules are missing
       from plain snapshots) and, where only the cuDNN frontend headers are missing, point TE at
       the ``nvidia-cudnn-frontend`` wheel the lock pins (ep_image/build_steps/build_te/source.py);
    3. build the wheel with the venv's own Python and no build isolation (TE's torch extension
       must compile against the venv's torch), with the environment variables TE's build reads
       (``CUDNN_PATH``/``CUDNN_HOME``, ``NVTE_FRAMEWORK``, ``NVTE_CUDA_ARCHS``, ``MAX_JOBS``,
       ``NVTE_BUILD_THREADS_PER_JOB``; ep_image/build_steps/build_te/environment.py);
    4. write ``te-build.json`` beside the wheel, so probes and the image can compare the cuDNN
       TE was built against with the one that is loaded.

    ``--dry-run`` prints the exact environment and command and exits 0. ``--skip REASON`` (or
    ``--mode skip``) writes a ``te-build.json`` that records that TE was not built (CPU-only
    test images). Host mode and the image's ``te`` stage run this same command. Without
    ``--venv`` it makes a throwaway venv from the lock (the ``moe`` extra without
    transformer-engine, ep_image/build_steps/_lock_sync.py); without a TE checkout (``--source``
    omitted, or ``--clone-unless-source`` and a directory without setup.py, as the image's
    default TE_SOURCE) it clones the git URL and commit pyproject.toml pins, through any
    ``url.<mirror>.insteadOf`` of the git config. Both are deleted when the build ends. Only
    the standard library is used (plus ep_image): this runs before anything else exists in an
    image. Exit codes: 0 built (or skipped, or a dry run); 1 an error that names its fix.
    """
    trust_store.use_system_trust_store()  # behind a TLS-inspecting proxy too
    try:
        if args.skip is not None:
            path = write_record(args.out, skip_record(args))
            print(f"build_te: TE build skipped ({args.skip}); recorded in {path}")
            return 0
        if args.uv is None:  # by name when on PATH: the printed commands stay pasteable
            args.uv = "uv" if shutil.which("uv") else pinned.find_uv()
        if args.dry_run:
            print_plan(*plan(args, args.venv, args.source))
            return 0
        if args.prebuilt is not None and (wheel := take_prebuilt(args)) is not None:
            print(f"build_te: {wheel} (prebuilt) and its {TE_RECORD} are in {args.out}")
            return 0
        with build_inputs(args) as (venv, source):
            planned = plan(args, venv, source)
            record = planned[2]
            wheel = build(args, venv, source, planned)
    except (BuildTeError, CudnnError, VenvError, pinned.ToolError) as err:
        # Each names its fix in its one message, as every build step's errors do.
        print(f"build_te: error: {err}", file=sys.stderr)
        return 1
    print(f"build_te: built {wheel} against cuDNN {record['cudnn_version']}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return cli.run(PROG, parse_args, run, argv, terminate_cleanly=True)
