"""Create one EP backend's venv under a prefix from the committed uv.lock, atomically: its three
build modes (a venv; the image's skeletons; completing a skeleton in place); the command line
and its typed options are in ``options``.
Why: the DeepEP backends all ship ``deep_ep``, and every backend brings its own native libraries,
so each gets a venv of its own, built from the lock alone.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from ep_image import backends as ep_backends
from ep_image import child_env, cli
from ep_image.build_steps import _lock_sync
from ep_image.build_steps import dedup as dedup_step
from ep_image.build_steps._source_builds import toolchain
from ep_image.build_steps._te_wheels import (
    TE_DISTRIBUTION,
    TE_DISTRIBUTIONS,
    install_te,
)
from ep_image.build_steps._uv import trust_store
from ep_image.build_steps._uv.run import BuildError, tail, uv_executable
from ep_image.build_steps._venv.layout import SKELETON_RECORD, VenvError
from ep_image.build_steps.make_venv.atomic_venv import (
    assert_relocated,
    building,
    move_into_place,
    new_temp_dir,
    prepare_prefix,
    remove_stale,
    stale_temp_dirs,
)
from ep_image.build_steps.make_venv.backend_sync import Wheels, sync_backend
from ep_image.build_steps.make_venv.bytecode import (
    compile_bytecode,
    compile_new_sources,
    python_sources,
)
from ep_image.build_steps.make_venv.options import (
    PROG,
    Mode,
    Options,
    parse_args,
)
from ep_image.build_steps.make_venv.venv_checks import (
    check_abi,
    check_files,
    check_imports,
    verify_backend,
)
from ep_image.build_steps.make_venv.venv_record import (
    SKELETONS_RECORD,
    build_info,
    installed_distributions,
    print_summary,
    read_skeleton,
    record_path,
    write_skeletons_record,
)
from ep_image.files.records import not_a_file, write_json

EXIT_BUILD_FAILED = 1


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
        _lock_sync.create_venv(uv, temp, opts.python, opts.project)
        nvshmem_build = sync_backend(
            uv, temp, backend, opts.project, skip, te=bool(opts.te_wheels),
            wheels=Wheels() if skeleton else opts.wheels,
        )  # fmt: skip
        shutil.rmtree(temp / toolchain.SCRATCH, ignore_errors=True)
        install_te(uv, temp, opts.te_wheels)
        _lock_sync.install_package(uv, temp)
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
    shutil.rmtree(venv / toolchain.SCRATCH, ignore_errors=True)
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
    records = [opts.prefix / SKELETONS_RECORD] if opts.mode is Mode.SKELETON else []
    if opts.mode is Mode.COMPLETE:
        records = [record_path(opts.prefix / name) for name in opts.backends]
    for record in records:
        if (why := not_a_file(record)) is not None:
            raise BuildError(
                f"{why}, where this build writes its record: remove it (a record is a regular "
                "file make_venv writes) and run again"
            )
    for wheel in opts.te_wheels:
        if not wheel.is_file():
            raise BuildError(
                f"--te-wheel {wheel} not found: build it first with python3 scripts/build_te.py"
            )


def run(opts: Options) -> int:
    """Build what ``opts`` asks for. A build error is one line naming its fix (each backend's
    as it fails, with --keep-going the others are still built), exit 1."""
    trust_store.use_system_trust_store()  # behind a TLS-inspecting proxy too
    failed: list[str] = []
    try:
        check_inputs(opts)
        prepare_prefix(opts.prefix)
        uv = uv_executable()
        _lock_sync.check_lock(uv, opts.project)
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
