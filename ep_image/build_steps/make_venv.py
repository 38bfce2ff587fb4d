"""Create one EP backend's venv under a prefix from the committed uv.lock, atomically: the CLI and
its three build modes (a venv; the image's skeletons; completing a skeleton in place).
Why: the backends all ship ``deep_ep``, so each needs a venv of its own, built from the lock alone.
"""

from __future__ import annotations

import contextlib
import enum
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ep_image import backends as ep_backends
from ep_image import child_env, cli, source_build, tools
from ep_image.build_steps import dedup as dedup_step
from ep_image.build_steps import lock_sync
from ep_image.build_steps.atomic_venv import (
    assert_relocated,
    building,
    move_into_place,
    new_temp_dir,
    prepare_prefix,
    remove_stale,
    stale_temp_dirs,
)
from ep_image.build_steps.backend_sync import Wheels, sync_backend
from ep_image.build_steps.bytecode import (
    compile_bytecode,
    compile_new_sources,
    python_sources,
    wants_bytecode,
)
from ep_image.build_steps.te_wheels import (
    TE_DISTRIBUTION,
    TE_DISTRIBUTIONS,
    TE_RECORD,
    install_te,
    select_te_wheels,
)
from ep_image.build_steps.uv_run import BuildError, tail, uv_executable
from ep_image.build_steps.venv_checks import (
    check_abi,
    check_files,
    check_imports,
    verify_backend,
)
from ep_image.build_steps.venv_record import (
    SKELETONS_RECORD,
    build_info,
    installed_distributions,
    print_summary,
    read_skeleton,
    record_path,
    write_skeletons_record,
)
from ep_image.project import SKELETON_RECORD, VENV_RECORD, VenvError, write_json

PROG = "make_venv"
EXIT_BUILD_FAILED = 1


class Mode(enum.Enum):
    """What one run builds."""

    VENV = "venv"  # finished venvs, each under a temporary name renamed into place (host mode)
    SKELETON = "skeleton"  # the image's shared layer: every venv without its backend
    COMPLETE = "complete"  # the image's ep-<backend> stage: a skeleton completed in place


@dataclass
class Options:
    """What to build, as parsed from the command line."""

    backends: list[str]
    prefix: Path
    project: Path
    te_wheels: list[Path] = field(default_factory=list)
    python: str | None = None
    no_install_packages: list[str] = field(default_factory=list)
    keep_going: bool = False
    compile_bytecode: bool = False
    variant: str | None = None
    dedup: bool = False
    mode: Mode = Mode.VENV
    wheels: Wheels = field(default_factory=Wheels)


# --------------------------------------------------------------------------- build modes


@contextlib.contextmanager
def one_build(prefix: Path, name: str) -> Iterator[None]:
    """Hold the prefix's lock for ``name`` (atomic_venv.building); a venv without its one
    site-packages is a BuildError like any other."""
    with building(prefix, name):
        try:
            yield
        except VenvError as exc:
            raise BuildError(f"{exc}; uv venv did not finish") from None


def dedup_venvs(*venvs: Path) -> dict[str, object]:
    """Hardlink identical files inside and across ``venvs`` (ep_image/build_steps/dedup.py), in
    the layer that wrote them: the image asks for it, because linking in a later layer would
    copy each kept file up instead of saving anything."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "dedup.json"
        cmd = dedup_step.command("--json", report, *venvs)
        proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True)
        if proc.returncode != 0:
            names = ", ".join(map(str, venvs))
            raise BuildError(f"dedup.py failed on {names}: {tail(proc.stderr or proc.stdout)}")
        data = json.loads(report.read_text())
    return {k: data.get(k) for k in ("du_bytes_before", "du_bytes_after", "saved_bytes")}


def skeleton_skip(opts: Options, backend: ep_backends.Backend) -> list[str]:
    """What a skeleton leaves out: the skip list, and the backend's own distribution."""
    return [*opts.no_install_packages, backend.distribution]


def build_one(uv: str, name: str, opts: Options, skeleton: bool = False) -> Path:
    """Build ``<prefix>/<name>``; on any failure nothing is left under the prefix.

    The venv is built under a temporary name and renamed into place only when complete, its
    record written before the rename, so a rebuild replaces an existing venv only once the new
    one is complete. ``skeleton``: all but the backend's own distribution, recorded in
    ep-skeleton.json instead of ep-backend.json (the image's shared layer; ``complete_one``
    finishes it).
    """
    with one_build(opts.prefix, name):
        return _build_one(uv, name, opts, skeleton)


def _build_one(uv: str, name: str, opts: Options, skeleton: bool) -> Path:
    backend = ep_backends.get_backend(name, opts.project, opts.variant)
    skip = skeleton_skip(opts, backend) if skeleton else opts.no_install_packages
    remove_stale(opts.prefix, name)
    temp = new_temp_dir(opts.prefix, name)
    try:
        lock_sync.create_venv(uv, temp, opts.python, opts.project)
        nvshmem_build = sync_backend(
            uv, temp, backend, opts.project, skip, te=bool(opts.te_wheels),
            wheels=Wheels() if skeleton else opts.wheels,
        )  # fmt: skip
        shutil.rmtree(temp / source_build.SCRATCH, ignore_errors=True)
        install_te(uv, temp, opts.te_wheels)
        lock_sync.install_package(uv, temp)
        if opts.compile_bytecode:
            compile_bytecode(temp)
        dedup = dedup_venvs(temp) if opts.dedup and not skeleton else None
        installed = installed_distributions(uv, temp)
        check_files(temp)
        if not opts.no_install_packages and any(d["name"] == "torch" for d in installed):
            check_imports(temp, ["torch"])
        present = verify_backend(temp, backend, installed)
        checked = [*TE_DISTRIBUTIONS, *([] if skeleton else [backend.distribution])]
        abi_results = check_abi(temp, checked, strict=not opts.no_install_packages)
        assert_relocated(temp, temp.name)
        info = build_info(
            uv, temp, backend, opts.project, installed, present,
            skipped=[TE_DISTRIBUTION, *skip], te_wheels=opts.te_wheels,
            bytecode=opts.compile_bytecode, nvshmem_build=nvshmem_build,
        )  # fmt: skip
        info["dedup"] = dedup
        info["abi"] = abi_results
        write_json(record_path(temp, skeleton), info)
        final = opts.prefix / name
        move_into_place(temp, final)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    print_summary(final, info)
    return final


def complete_one(uv: str, name: str, opts: Options) -> Path:
    """Install the backend's own distribution into its skeleton ``<prefix>/<name>``, in place.

    Why in place: the image's ep-<backend> stage sits on the layer holding every skeleton; a
    temporary copy renamed into place would put the whole venv into this stage's layer again.
    The stage's RUN is the unit of atomicity there (a failed RUN leaves no layer); elsewhere
    a failure leaves ep-skeleton.json and no ep-backend.json, so nothing takes it for a venv.
    """
    with one_build(opts.prefix, name):
        return _complete_one(uv, name, opts)


def _complete_one(uv: str, name: str, opts: Options) -> Path:
    backend = ep_backends.get_backend(name, opts.project, opts.variant)
    venv = opts.prefix / name
    wanted = [TE_DISTRIBUTION, *skeleton_skip(opts, backend)]
    skeleton = read_skeleton(name, venv, opts.project, wanted)
    before = python_sources(venv) if opts.compile_bytecode else {}
    nvshmem_build = sync_backend(
        uv, venv, backend, opts.project, opts.no_install_packages,
        te=bool(skeleton.get("te_wheels")), inexact=True, wheels=opts.wheels,
    )  # fmt: skip
    shutil.rmtree(venv / source_build.SCRATCH, ignore_errors=True)
    if opts.compile_bytecode:
        compile_new_sources(venv, before)
    installed = installed_distributions(uv, venv)
    check_files(venv, [backend.distribution])
    present = verify_backend(venv, backend, installed)
    abi_results = check_abi(venv, [backend.distribution], strict=not opts.no_install_packages)
    info = build_info(
        uv, venv, backend, opts.project, installed, present,
        skipped=[TE_DISTRIBUTION, *opts.no_install_packages], te_wheels=[],
        bytecode=opts.compile_bytecode, nvshmem_build=nvshmem_build,
    )  # fmt: skip
    info["te_wheels"] = skeleton.get("te_wheels", [])
    info["dedup"] = None
    info["completed_from_skeleton"] = skeleton.get("created")
    info["abi"] = abi_results
    write_json(record_path(venv), info)
    record_path(venv, skeleton=True).unlink()
    print_summary(venv, info)
    return venv


def build_skeletons(uv: str, opts: Options) -> list[Path]:
    """``--skeleton``: every backend the project defines, without its own distribution,
    hardlinked together, so the shared files sit once in a layer below every ``ep-<backend>``
    stage and an image with several backends copies only what differs
    (ep_image/build_steps/image_stage.py). The record says which; backends the project lacks
    (a fork, a test) are skipped."""
    built, absent = [], {}
    for name in opts.backends:
        try:
            ep_backends.get_backend(name, opts.project, opts.variant)
        except ep_backends.RegistryError as exc:
            absent[name] = str(exc)
            print(f"make_venv: {name}: no skeleton, the project lacks it: {exc}", flush=True)
            continue
        built.append(build_one(uv, name, opts, skeleton=True))
    if not built:
        raise BuildError(f"the project at {opts.project} defines none of {opts.backends}")
    dedup = None
    if opts.dedup:
        dedup = dedup_venvs(*built)
        print(f"make_venv: skeletons deduplicated: {dedup}", flush=True)
    write_skeletons_record(
        opts.prefix, built, absent, opts.project, opts.no_install_packages, dedup
    )
    return built


# --------------------------------------------------------------------------- CLI


def check_inputs(opts: Options) -> None:
    """Fail before building anything if an input is missing."""
    for name in ("pyproject.toml", "uv.lock"):
        if not (opts.project / name).is_file():
            raise BuildError(
                f"{opts.project / name} not found: --project must be the directory that holds "
                "pyproject.toml and the committed uv.lock"
            )
    for wheel in opts.te_wheels:
        if not wheel.is_file():
            raise BuildError(
                f"--te-wheel {wheel} not found: build it first with "
                "python3 -m ep_image.build_steps.build_te"
            )


def build_parser() -> cli.Parser:
    """The command line (documentation included); ``parse_args`` checks what it cannot."""
    parser = cli.Parser(
        prog=PROG,
        description=(
            "Create <prefix>/<backend>, a venv holding one EP backend, from the committed "
            "uv.lock (uv sync --frozen --extra <backend>), plus Transformer Engine from a wheel "
            "built once by build_te. The venv is built under a temporary name and "
            f"renamed into place when complete, with <venv>/{VENV_RECORD} saying what it holds."
        ),
        epilog=(
            f"Backends: {ep_backends.valid_names_text()}. Exit codes: 0 built; 1 the build "
            "failed (nothing left behind); 2 bad usage (e.g. an unknown backend); 130 "
            "interrupted. Example: "
            f"python3 -m ep_image.build_steps.make_venv --backend {ep_backends.DEFAULT_BACKEND} "
            "--prefix /opt/venvs "
            "--te-wheel /wheels/transformer_engine-2.17.0-cp312-cp312-linux_x86_64.whl"
        ),
    )
    parser.add_argument(
        "--backend",
        required=True,
        action="append",
        metavar="NAME",
        help=(
            "the backend to build: "
            f"{ep_backends.valid_names_text()}; host mode also takes 'all', a comma list "
            "or the flag repeated, and builds each in turn"
        ),
    )
    parser.add_argument(
        "--prefix", required=True, type=Path, help="directory that holds the backend venvs"
    )
    parser.add_argument(
        "--project",
        type=Path,
        default=ep_backends.DEFAULT_PROJECT,
        help="directory with pyproject.toml and uv.lock (default: this repository)",
    )
    parser.add_argument(
        "--te-wheel",
        action="append",
        default=[],
        type=Path,
        metavar="PATH",
        help="Transformer Engine wheel from build_te.py, installed with --no-deps (repeatable)",
    )
    parser.add_argument(
        "--te-wheel-dir",
        type=Path,
        metavar="DIR",
        help=(
            "install every transformer_engine-*.whl in DIR (the image's te stage output); "
            "a DIR without one means no TE, which is said, not an error"
        ),
    )
    parser.add_argument(
        "--te-record",
        type=Path,
        metavar="FILE",
        help=(
            f"with --te-wheel-dir: install exactly the wheel this {TE_RECORD} names (none if "
            "it says TE was skipped), and fail unless DIR holds the same record and that "
            "wheel with its sha256 (the image's ep stages, which mount DIR)"
        ),
    )
    parser.add_argument("--python", help="interpreter for the venv (passed to uv venv --python)")
    parser.add_argument(
        "--no-install-package",
        action="append",
        default=[],
        metavar="PKG",
        help=(
            "also skip this package (repeatable). For footprint estimates only, e.g. a backend "
            f"without its git-built deep-ep; {VENV_RECORD} then says backend_installed=false"
        ),
    )
    parser.add_argument(
        "--no-install-packages",
        default="",
        metavar="LIST",
        help="the same for a space- or comma-separated LIST (the image's VENV_SKIP_PACKAGES)",
    )
    parser.add_argument(
        "--compile-bytecode",
        action="store_true",
        help=(
            "compile site-packages to hash-checked .pyc files that are identical across venvs "
            "(so dedup.py can share them); also on when UV_COMPILE_BYTECODE is set, which is "
            "then not passed to uv"
        ),
    )
    parser.add_argument(
        "--variant",
        metavar="EXTRA",
        help=(
            "install the one --backend from this variant's extra instead (same venv name, same "
            "probes): "
            + ", ".join(
                f"{v.extra} ({s.name}: {v.summary})" for s in ep_backends.SPECS for v in s.variants
            )
        ),
    )
    parser.add_argument(
        "--dedup",
        action="store_true",
        help=(
            "hardlink identical files inside the new venv before it is moved into place "
            "(dedup.py; the image's ep stages, whose layer a one-backend image reuses)"
        ),
    )
    steps = parser.add_mutually_exclusive_group()
    steps.add_argument(
        "--skeleton",
        action="store_true",
        help=(
            "the image's shared layer: each backend's venv without its own distribution "
            f"({SKELETON_RECORD}), deduplicated across them with --dedup; backends the project "
            f"lacks are skipped, and <prefix>/{SKELETONS_RECORD} says which"
        ),
    )
    steps.add_argument(
        "--complete",
        action="store_true",
        help=(
            "the image's ep-<backend> stage: install the backend's distribution into its "
            "skeleton in place (same lock and skip list, else exit 1); --te-* are not needed"
        ),
    )
    parser.add_argument(
        "--prebuilt-wheels",
        type=Path,
        metavar="DIR",
        help=(
            "take a source-built backend's wheel from DIR instead of compiling it, when the "
            "record beside it (<backend>-wheel.json) matches this build: pinned commit, locked "
            "torch/NVSHMEM/NCCL, arch list, CUDA home, nvcc, declared build variables, Python; "
            "else compile, saying which field differs (the image's PREBUILT_WHEELS)"
        ),
    )
    parser.add_argument(
        "--export-wheels",
        type=Path,
        metavar="DIR",
        help=(
            "after compiling a source-built backend, copy the wheel uv built into DIR with its "
            "record, for --prebuilt-wheels later (a CI cache, another machine)"
        ),
    )
    parser.add_argument(
        "--keep-going",
        action="store_true",
        help="with several backends, build the others when one fails (exit 1 at the end)",
    )
    return parser


def parse_args(argv: Sequence[str] | None) -> Options:
    """The options; a UsageError for bad usage (exit 2), a FixableError for a TE record that
    does not match its wheel (exit 1)."""
    args = build_parser().parse_args(argv)
    try:
        backends = ep_backends.expand_backends(args.backend)
    except ep_backends.UnknownBackendError as exc:
        raise cli.UsageError(str(exc)) from None
    if args.variant is not None:
        if len(backends) != 1:
            raise cli.UsageError("--variant takes exactly one --backend")
        try:
            ep_backends.get_backend(backends[0], args.project.resolve(), args.variant)
        except (ep_backends.UnknownBackendError, ep_backends.RegistryError) as exc:
            raise cli.UsageError(str(exc)) from None
    if args.te_record is not None and args.te_wheel_dir is None:
        raise cli.UsageError("--te-record needs --te-wheel-dir")
    te_wheels = select_te_wheels(args.te_wheel, args.te_wheel_dir, args.te_record)
    skip = [*args.no_install_package, *args.no_install_packages.replace(",", " ").split()]
    mode = Mode.SKELETON if args.skeleton else Mode.COMPLETE if args.complete else Mode.VENV
    return Options(
        backends=backends,
        prefix=args.prefix.resolve(),
        project=args.project.resolve(),
        te_wheels=te_wheels,
        python=args.python,
        no_install_packages=skip,
        keep_going=args.keep_going,
        compile_bytecode=wants_bytecode(args.compile_bytecode),
        variant=args.variant,
        dedup=args.dedup,
        mode=mode,
        wheels=Wheels(
            args.prebuilt_wheels.resolve() if args.prebuilt_wheels else None,
            args.export_wheels.resolve() if args.export_wheels else None,
        ),
    )


def run(opts: Options) -> int:
    """Build what ``opts`` asks for. A build error is one line naming its fix (each backend's
    as it fails, with --keep-going the others are still built), exit 1."""
    tools.use_system_trust_store()  # behind a TLS-inspecting proxy too
    failed: list[str] = []
    try:
        check_inputs(opts)
        prepare_prefix(opts.prefix)
        uv = uv_executable()
        lock_sync.check_lock(uv, opts.project)
        if opts.mode is Mode.SKELETON:
            build_skeletons(uv, opts)
            return 0
        build = complete_one if opts.mode is Mode.COMPLETE else build_one
        for name in opts.backends:
            try:
                build(uv, name, opts)
            except BuildError as exc:
                print(f"{PROG}: error: {exc}", file=sys.stderr)
                failed.append(name)
                if not opts.keep_going:
                    break
    except BuildError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_BUILD_FAILED
    except OSError as exc:  # writing the venv, its record, the prefix itself
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        fix = cli.os_error_fix(exc, opts.prefix, "check the path above, then run again")
        print(f"{PROG}: fix: {fix}", file=sys.stderr)
        return EXIT_BUILD_FAILED
    except KeyboardInterrupt:
        # Said from what is there: a second signal can stop the cleanup itself.
        left = [p.name for name in opts.backends for p in stale_temp_dirs(opts.prefix, name)]
        if left:
            print(
                f"{PROG}: interrupted while cleaning up: {', '.join(left)} is still under "
                f"{opts.prefix}; the next make_venv of the same backend removes it",
                file=sys.stderr,
            )
        else:
            print(
                f"{PROG}: no half-built venv is left under {opts.prefix} (a venv being "
                f"completed in place keeps its {SKELETON_RECORD}: run --complete again)",
                file=sys.stderr,
            )
        raise
    if failed:
        print(
            f"{PROG}: failed: {', '.join(failed)} (each error above names its fix)",
            file=sys.stderr,
        )
        return EXIT_BUILD_FAILED
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return cli.run(PROG, parse_args, run, argv, terminate_cleanly=True)


if __name__ == "__main__":
    sys.exit(main())
