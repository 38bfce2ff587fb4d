"""Create one EP backend's venv under a prefix, from the committed uv.lock, atomically.

Why: the three EP backends ship the same module ``deep_ep`` and cannot share a venv, so an
image or a host prefix holds one venv per backend (``<prefix>/<backend>``). Each must be built
from the lock alone (``uv sync --frozen``: no re-resolution, the same pins in CI, the image and
on a cluster) and must never be seen half-built by ``use-ep`` or a probe.

How:
- ``uv venv --relocatable <prefix>/.<backend>.tmp-XXXX`` then ``UV_PROJECT_ENVIRONMENT=<that>
  uv sync --frozen --no-install-project --extra <backend> --no-install-package
  transformer-engine``. The project is virtual (``[tool.uv] package = false``), so
  ``--no-install-project`` changes nothing today; it is there so that flipping that setting can
  never drop the repository itself into a backend venv.
- Transformer Engine is built once by ep_image/build/build_te.py and installed into every backend's
  venv from that wheel with ``uv pip install --no-deps``; it is never rebuilt per backend.
- The venv is built under a temporary name and renamed into place only when complete, with
  ``ep-backend.json`` (backend, extra, lock hash, what was installed) written before the
  rename. A failed or interrupted build leaves no ``<prefix>/<backend>``; a rebuild replaces an
  existing one only once the new one is complete. This works because uv's relocatable venvs
  embed no absolute path of their own: entry points find their interpreter relative to
  themselves and the activate scripts compute the venv's location. Before the rename the
  script checks that no file in ``bin/`` names the temporary directory.

- The image builds each venv in two layers (``--skeleton``, then ``--complete``): one stage
  makes every backend's venv without the backend's own distribution (``ep-skeleton.json``
  instead of ``ep-backend.json``) and hardlinks them together; each ``ep-<backend>`` stage
  then installs that one distribution in place. The shared files then sit once in a layer
  below every backend, so an image with several backends copies only what differs
  (ep_image/build/image_stage.py). A venv holding ``ep-skeleton.json`` is not finished: nothing
  activates or probes it, and a failed ``--complete`` leaves it that way.

- A backend whose build needs NVSHMEM (HybridEP, see ``BackendSpec.build_needs``) is synced in
  two steps: everything but its own distribution, then that distribution built against the
  venv's own nvidia-nvshmem-cu13 with a ``$ORIGIN`` runpath (ep_image/nvshmem.py). The image's
  ep stages run this same script, so host mode and the image build it identically.

HybridEP is a git source (github.com/deepseek-ai/DeepEP). Where the clone fails, the error says
so and names the two fixes: network to GitHub, or a mirror through git's
``url.<mirror>.insteadOf`` (in an image build: the ``gitconfig`` build secret).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ep_image import abi, child_env, nvshmem, source_build, tools
from ep_image import backends as ep_backends
from ep_image.project import SKELETON_RECORD as SKELETON_FILE
from ep_image.project import VENV_RECORD as INFO_FILE
from ep_image.project import VenvError, sha256_file, write_json
from ep_image.project import site_packages as site_packages_of

SKELETONS_RECORD = "venvs-common.json"  # the --skeleton run: which, from what, deduplicated
TE_DISTRIBUTION = "transformer-engine"
#: What a TE build may install besides TE itself (its framework and core wheels).
TE_DISTRIBUTIONS = (TE_DISTRIBUTION, "transformer-engine-torch", "transformer-engine-cu13")
TE_EXTRA = "te"  # TE's runtime dependencies and cuDNN, from the lock
EXIT_BUILD_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # as a shell reports a command ended by Ctrl-C
_GIT_FAILURE_SIGNS = ("git operation failed", "failed to clone", "failed to fetch commit")


class BuildError(RuntimeError):
    """The venv could not be built; the message says why and what fixes it."""


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
    mode: str = "venv"  # "venv", "skeleton" or "complete" (the image's two steps)


# --------------------------------------------------------------------------- helpers


def uv_executable() -> str:
    """Path of uv, or a BuildError naming the pinned version and how to install it."""
    try:
        return tools.find_uv()
    except tools.ToolError as exc:
        raise BuildError(str(exc)) from None


def run(cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    """Run ``cmd``, streaming its output (long builds stay visible), and return its stderr.

    On failure raises BuildError carrying that stderr, for callers to classify.
    """
    print("+ " + " ".join(cmd), flush=True)
    with subprocess.Popen(cmd, env=env, cwd=cwd, stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stderr is not None
        lines = []
        for line in proc.stderr:
            sys.stderr.write(line)
            lines.append(line)
    sys.stderr.flush()
    stderr = "".join(lines)
    if proc.returncode != 0:
        raise BuildError(stderr or f"{cmd[0]} exited with {proc.returncode}")
    return stderr


def tail(text: str, count: int = 6) -> str:
    """The last ``count`` non-blank lines of a tool's output (the rest is printed above)."""
    return "\n".join([line for line in text.splitlines() if line.strip()][-count:])


def git_fix_message(backend: ep_backends.Backend, uv_error: str) -> str:
    """The error for a git source that could not be cloned, naming both fixes."""
    return (
        f"{backend.name}: uv could not clone the git source of {backend.distribution} "
        f"({backend.source_label}), pinned in pyproject.toml [tool.uv.sources]. "
        "The fetch failed (no route to GitHub, or a git mirror that lacks the commit). "
        "Fix: give the build network access to github.com, "
        "or point git at a mirror that holds that commit (and its submodules), e.g. "
        f"`git config --global url.<mirror-url>.insteadOf {backend.git}` "
        "(in an image build: pass that git config as the build secret `gitconfig`, "
        "docs/image.md). "
        f"uv's error (in full above) ends:\n{tail(uv_error)}"
    )


def looks_like_git_failure(uv_error: str) -> bool:
    lowered = uv_error.lower()
    return any(sign in lowered for sign in _GIT_FAILURE_SIGNS)


def site_packages(venv: Path) -> Path:
    """The venv's site-packages (lib/pythonX.Y/site-packages)."""
    try:
        return site_packages_of(venv)
    except VenvError as exc:
        raise BuildError(f"{exc}; uv venv did not finish") from None


def installed_distributions(uv: str, venv: Path) -> list[dict[str, str]]:
    """``[{name, version}]`` of everything in the venv, as uv lists it."""
    proc = subprocess.run(
        [uv, "pip", "list", "--python", str(venv / "bin" / "python"), "--format", "json"],
        capture_output=True,
        text=True,
        check=True,
    )
    return sorted(
        ({"name": d["name"], "version": d["version"]} for d in json.loads(proc.stdout)),
        key=lambda d: ep_backends.normalize(d["name"]),
    )


def pip_check(uv: str, venv: Path, project: Path) -> dict[str, object]:
    """``uv pip check``: records missing requirements (e.g. TE's, installed with --no-deps).

    Run in ``project``: uv applies that project's ``dependency-metadata`` to what it checks.
    """
    proc = subprocess.run(
        [uv, "pip", "check", "--python", str(venv / "bin" / "python")],
        capture_output=True,
        text=True,
        check=False,
        cwd=project,
    )
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    output = "\n".join(line for line in lines if not line.startswith("Using Python"))
    if proc.returncode != 0:
        print(f"make_venv: warning: uv pip check reports problems:\n{output}", file=sys.stderr)
    return {"ok": proc.returncode == 0, "output": output}


# --------------------------------------------------------------------------- one venv


def stale_temp_dirs(prefix: Path, backend: str) -> list[Path]:
    """What an interrupted run of this backend left in the prefix: its temporary build dir, or
    the replaced venv a kill during the final rename kept (``move_into_place``)."""
    found = [*prefix.glob(f".{backend}.tmp-*"), *prefix.glob(f".{backend}.old-*")]
    return sorted(p for p in found if p.is_dir() and not p.is_symlink())


def lock_path(prefix: Path, backend: str) -> Path:
    return prefix / f".make_venv-{backend}.lock"


@contextlib.contextmanager
def building(prefix: Path, backend: str) -> Iterator[None]:
    """Hold ``<prefix>/.make_venv-<backend>.lock`` while ``backend`` is built there.

    Why: a second build of the same venv into the same prefix would take the first one's live
    temporary directory for an interrupted build's and delete it. It fails at once instead,
    naming the build that holds the lock. The file is removed when the build ends; a lock taken
    on a file that was removed meanwhile is retaken on the new one.
    """
    path = lock_path(prefix, backend)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise BuildError(
                f"{backend}: another make_venv (pid {holder}) is building it into {prefix}. "
                "Fix: wait for that build to end, or build into another --prefix"
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)


def prepare_prefix(prefix: Path) -> None:
    """Make ``prefix`` or say, in one line, why it cannot be used."""
    try:
        if prefix.exists() and not prefix.is_dir():
            raise BuildError(f"--prefix {prefix} is a file, not a directory. Fix: pass a directory")
        prefix.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BuildError(
            f"cannot create --prefix {prefix}: {exc.strerror}. Fix: pass a directory you can "
            "write, or create it with the right owner first"
        ) from None
    if not os.access(prefix, os.W_OK | os.X_OK):
        raise BuildError(
            f"--prefix {prefix} is not writable by this user. Fix: pass a directory you can "
            "write (e.g. under $HOME or a scratch file system), or fix its permissions"
        )


def new_temp_dir(prefix: Path, backend: str) -> Path:
    """A fresh name ``<prefix>/.<backend>.tmp-XXXX`` that uv venv will create."""
    path = Path(tempfile.mkdtemp(prefix=f".{backend}.tmp-", dir=prefix))
    path.rmdir()
    return path


def create_venv(uv: str, venv: Path, python: str | None, project: Path) -> None:
    cmd = [uv, "venv", "--relocatable"]
    if python:
        cmd += ["--python", python]
    run([*cmd, str(venv)], cwd=project)


def sync_command(
    uv: str,
    backend: ep_backends.Backend,
    project: Path,
    skip: list[str],
    te: bool,
    inexact: bool = False,
) -> list[str]:
    """``uv sync --frozen`` of the backend's extra (plus ``te``: TE's runtime dependencies and
    the cuDNN it was built against come from the lock, only TE itself from the prebuilt wheel).
    ``inexact``: completing a skeleton, which already holds TE (installed apart from the lock).
    """
    cmd = [
        uv,
        "sync",
        "--frozen",
        "--no-install-project",
        "--project",
        str(project),
        "--extra",
        backend.extra,
        *(["--extra", TE_EXTRA] if te else []),
        *(["--inexact"] if inexact else []),
    ]
    for package in [TE_DISTRIBUTION, *skip]:
        cmd += ["--no-install-package", package]
    return cmd


def sync_backend(
    uv: str,
    venv: Path,
    backend: ep_backends.Backend,
    project: Path,
    skip: list[str],
    te: bool,
    inexact: bool = False,
) -> dict[str, object] | None:
    """Sync the backend's extra into ``venv``; returns the build set-up record, if it needed one.

    A backend whose build needs the venv's NVSHMEM or NCCL is synced in two steps: all but its
    distribution, then the distribution built against the venv's libraries (NVSHMEM:
    ep_image/nvshmem.py, checked afterwards; NCCL: on the build's LIBRARY_PATH).
    """
    env = {**os.environ, "UV_PROJECT_ENVIRONMENT": str(venv)}
    env.pop("UV_COMPILE_BYTECODE", None)
    cmd = sync_command(uv, backend, project, skip, te, inexact)
    skipped = any(
        ep_backends.normalize(p) == ep_backends.normalize(backend.distribution) for p in skip
    )
    # A git source is compiled here: NVSHMEM set-up and checks where the registry says so (a
    # prebuilt wheel, in a fork or a test project, brings its own runpath; the ABI check binds it).
    compiled = bool(backend.git) and not skipped
    builds_nvshmem = ep_backends.NVSHMEM in backend.build_needs and compiled
    links_nccl = ep_backends.NCCL in backend.build_needs and compiled
    if compiled:
        env.update(prepare_source_build(uv, venv, backend, project, env))
    try:
        if not (builds_nvshmem or links_nccl):
            run(cmd, env=env, cwd=project)
            return None
        run([*cmd, "--no-install-package", backend.distribution], env=env, cwd=project)
        build_env = nvshmem.build_environment(venv, env) if builds_nvshmem else {}
        if links_nccl:
            build_env.update(source_build.nccl_link(site_packages(venv), {**env, **build_env}))
        print(f"make_venv: {backend.name}: building against {build_env}", flush=True)
        run(cmd, env={**env, **build_env}, cwd=project)
        if not builds_nvshmem:
            return build_env
        try:
            checked = nvshmem.check_extension(venv)
        except nvshmem.NvshmemError as exc:
            # A wheel from uv's cache built without this set-up: rebuild it once, here.
            print(f"make_venv: {exc}\nmake_venv: rebuilding {backend.distribution}", flush=True)
            refresh = ["--refresh-package", backend.distribution]
            refresh += ["--reinstall-package", backend.distribution]
            run([*cmd, *refresh], env={**env, **build_env}, cwd=project)
            checked = nvshmem.check_extension(venv)
        return {**build_env, "extension": checked}
    except (nvshmem.NvshmemError, source_build.LinkError) as exc:
        raise BuildError(f"{backend.name}: {exc}") from None
    except BuildError as exc:
        if backend.git and looks_like_git_failure(str(exc)):
            raise BuildError(git_fix_message(backend, str(exc))) from None
        raise BuildError(
            f"{backend.name}: uv sync failed (output above); it ends:\n{tail(str(exc))}"
        ) from None


def prepare_source_build(
    uv: str, venv: Path, backend: ep_backends.Backend, project: Path, env: dict[str, str]
) -> dict[str, str]:
    """Before a backend is compiled: what it will miss (with the fix), the NVML stub its
    multi-node build links, and uv's cache keyed on the build's environment inputs
    (ep_image/source_build.py). Returns the variables to add to the build's environment."""
    variables = (
        source_build.declared_variables(ep_backends.read_pyproject(project), backend.distribution)
        if ep_backends.spec(backend.name).reads_build_variables
        else {}
    )
    needs_nvshmem = ep_backends.NVSHMEM in backend.build_needs
    problems = source_build.preflight(variables, env, nvshmem=needs_nvshmem)
    if problems:
        raise BuildError(f"{backend.name} cannot be built here:\n  - " + "\n  - ".join(problems))
    # Inside the temporary venv, which is renamed into place: removed after the build.
    links = source_build.driver_links(variables)
    extra = source_build.link_stubs(env, venv / source_build.SCRATCH, links)
    if source_build.multinode_doca(variables):  # setup.py runs NCCL's `make -j` unbounded
        extra.update(source_build.bounded_make(env, venv / source_build.SCRATCH))
    key = source_build.build_key({**env, **extra}, variables)
    try:
        state = source_build.refresh_cache(uv, backend.distribution, key, env, backend.extra)
    except source_build.CacheError as exc:
        raise BuildError(f"{backend.name}: {exc}") from None
    print(
        f"make_venv: {backend.name}: build key {source_build.key_digest(key)[:12]} ({state}"
        + ("; its cached builds dropped" if state == "changed" else "")
        + f"){', driver stubs on LIBRARY_PATH' if 'LIBRARY_PATH' in extra else ''}"
        + f"{', make -j bounded to ' + extra['EP_MAKE_JOBS'] if 'EP_MAKE_JOBS' in extra else ''}",
        flush=True,
    )
    return extra


def install_te(uv: str, venv: Path, wheels: list[Path]) -> None:
    """The Transformer Engine wheel(s) built once by build_te.py, without re-resolving.

    ``--no-config``: a built wheel needs none of the project's build settings (its
    extra-build-dependencies would otherwise apply to the transformer-engine name).
    """
    if wheels:
        python = str(venv / "bin" / "python")
        cmd = [uv, "pip", "install", "--no-config", "--python", python, "--no-deps"]
        run([*cmd, *map(str, wheels)])


def install_project(uv: str, venv: Path, project: Path) -> None:
    """This package, editable and without dependencies: the venv's bin/ gets the probes
    (``check-ep``, ...) and its Python imports the very ep_image of ``project``."""
    python = str(venv / "bin" / "python")
    run([uv, "pip", "install", "--python", python, "--no-deps", "--editable", str(project)])


def wants_bytecode(flag: bool) -> bool:
    """--compile-bytecode, or uv's own switch UV_COMPILE_BYTECODE set in the environment."""
    value = os.environ.get("UV_COMPILE_BYTECODE", "").strip().lower()
    return flag or value not in ("", "0", "false", "no", "off")


def compile_bytecode(venv: Path, only: list[Path] | None = None) -> None:
    """Compile site-packages so that identical sources give identical .pyc files in every venv.

    uv's own compilation (UV_COMPILE_BYTECODE) writes timestamp-validated .pyc files that embed
    the absolute source path, here the temporary build path: they differ per venv, cannot be
    deduplicated, and pin each source's mtime (dedup.py then keeps those sources apart too).
    Instead: hash-checked .pyc files (valid whatever the mtime) with the path stored relative
    to site-packages (``-s``/``-p``); importlib rewrites ``co_filename`` to the real path when
    it loads a .pyc, so tracebacks still name the venv's files. ``-f``: a single timestamp .pyc
    left (e.g. ``_distutils_hack``'s, written when a ``.pth`` imports it at interpreter start)
    would make dedup.py link every ``.py`` only by mtime (measured: 1.05x instead of 1.02x for a
    second backend in the image). Files that do not compile
    (test data in some wheels) are skipped, as uv skips them. ``only``: just these sources
    (completing a skeleton: rewriting the skeleton's .pyc files would copy them into the layer).
    """
    sp = site_packages(venv)
    if only is not None and not only:
        return
    cmd = [
        str(venv / "bin" / "python"),
        "-m",
        "compileall",
        "-q",
        "-f",  # also the timestamp .pyc an interpreter start already wrote (a .pth's import)
        "-j",
        "0",
        "--invalidation-mode",
        "checked-hash",
        "-s",
        str(sp),
        "-p",
        "",
        *(["-i", "-"] if only is not None else [str(sp)]),
    ]
    print("+ " + " ".join(cmd) + (f" ({len(only)} new sources)" if only is not None else ""))
    sources = "".join(f"{path}\n" for path in only or [])
    proc = subprocess.run(cmd, input=sources, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        failed = sum(1 for line in proc.stdout.splitlines() if line.startswith("***"))
        print(f"make_venv: bytecode: {failed or 'some'} files did not compile (skipped)")


def verify_backend(
    venv: Path, backend: ep_backends.Backend, installed: list[dict[str, str]]
) -> bool:
    """Check the backend's deep_ep landed and no other backend's did; True if installed."""
    names = {ep_backends.normalize(d["name"]) for d in installed}
    own = ep_backends.normalize(backend.distribution)  # a variant's, e.g. deep-ep for deepep_v2
    others = [
        d
        for d in ep_backends.other_distributions(backend.name)
        if ep_backends.normalize(d) in names and ep_backends.normalize(d) != own
    ]
    if others:
        raise BuildError(f"{backend.name}: other backends' distributions installed: {others}")
    if ep_backends.normalize(backend.distribution) not in names:
        return False
    marker = site_packages(venv) / backend.marker_file
    layout = ep_backends.layout_backend(site_packages(venv) / ep_backends.MODULE)
    if not marker.is_file() or layout != backend.name:
        raise BuildError(
            f"{backend.name}: {backend.distribution} is installed but its deep_ep is "
            f"{f'the {layout} layout' if layout else 'no known layout'}, not {backend.name}'s "
            f"({backend.marker_file}): check the pin in pyproject.toml"
        )
    return True


def assert_relocated(venv: Path, temp_name: str) -> None:
    """No script in bin/ may name the temporary directory (it is about to be renamed)."""
    offenders = []
    for path in [*(venv / "bin").iterdir(), venv / "pyvenv.cfg"]:
        small_file = path.is_file() and not path.is_symlink() and path.stat().st_size < 1 << 20
        if small_file and temp_name.encode() in path.read_bytes():
            offenders.append(path.name)
    if offenders:
        raise BuildError(
            f"files in the venv embed its temporary path {temp_name}: {offenders}; "
            "this uv does not honour relocatable venvs for them (upgrade uv)"
        )


def check_abi(venv: Path, distributions: list[str], strict: bool) -> list[dict[str, object]]:
    """Bind every compiled extension of ``distributions`` to the venv's own torch, NCCL, ...
    (ep_image/abi.py); a BuildError names the first symbol that does not bind and the fix.
    ``strict``: a library not found fails too (off for a venv that leaves packages out).

    Why here: a venv whose backend was built against another torch installs cleanly and fails
    at import on every GPU node; this refuses it before it is moved into place.
    """
    site = site_packages(venv)
    try:
        results = abi.check(site, venv / "bin" / "python", distributions)
    except abi.ld_trace.LoaderError as exc:
        raise BuildError(f"the ABI check could not run: {exc}") from None
    version = abi.torch_version(site)
    problems = [line for r in results for line in r.problems(version, strict)]
    for result in results:
        ext = Path(result.extension).name
        state = "ok" if result.ok else "FAILS"
        notes = {
            "stub": ["driver symbols against the CUDA toolkit's stub"],
            "absent": ["driver symbols not checked (no driver or toolkit stub here)"],
        }.get(result.driver, [])
        if not result.complete:
            notes.append(f"not found, so not checked: {', '.join(result.not_found)}")
        detail = f" ({'; '.join(notes)})" if notes else ""
        print(f"make_venv: ABI {state}: {ext} binds to this venv's libraries{detail}", flush=True)
    if problems:
        raise BuildError("\n  - ".join(["the venv would not import:", *problems]))
    return [r.to_json() for r in results]


def uv_version(uv: str) -> str:
    return subprocess.run([uv, "--version"], capture_output=True, text=True).stdout.strip()


def python_version(venv: Path) -> str:
    cfg = (venv / "pyvenv.cfg").read_text()
    for line in cfg.splitlines():
        key, _, value = line.partition("=")
        if key.strip() in ("version_info", "version"):
            return value.strip()
    return "unknown"


def build_info(
    uv: str,
    venv: Path,
    backend: ep_backends.Backend,
    opts: Options,
    installed: list[dict[str, str]],
    backend_installed: bool,
    nvshmem_build: dict[str, object] | None = None,
    skipped: list[str] | None = None,
) -> dict[str, object]:
    """The content of ep-backend.json (and of a skeleton's ep-skeleton.json)."""
    return {
        "backend": backend.name,
        "extra": backend.extra,
        "module": ep_backends.MODULE,
        "distribution": backend.distribution,
        "requirement": backend.requirement,
        "source": backend.source_label,
        "backend_installed": backend_installed,
        "marker_file": backend.marker_file,
        "lock_sha256": sha256_file(opts.project / "uv.lock"),
        "pyproject_sha256": sha256_file(opts.project / "pyproject.toml"),
        "python": python_version(venv),
        "uv": uv_version(uv),
        "skipped_packages": skipped or [TE_DISTRIBUTION, *opts.no_install_packages],
        "te_wheels": [{"file": w.name, "sha256": sha256_file(w)} for w in opts.te_wheels],
        "installed": installed,
        "pip_check": pip_check(uv, venv, opts.project),
        "nvshmem_build": nvshmem_build,
        "relocatable": True,
        "bytecode": "checked-hash, paths relative to site-packages"
        if opts.compile_bytecode
        else None,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "created_by": "ep_image.build.make_venv",
    }


def dedup_venvs(*venvs: Path) -> dict[str, object]:
    """Hardlink identical files inside and across ``venvs`` (ep_image/build/dedup.py), in the layer
    that wrote them: the image asks for it, because linking in a later layer would copy each
    kept file up instead of saving anything."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "dedup.json"
        cmd = [
            sys.executable,
            "-m",
            "ep_image.build.dedup",
            "--json",
            str(report),
            *map(str, venvs),
        ]
        proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True)
        if proc.returncode != 0:
            names = ", ".join(map(str, venvs))
            raise BuildError(f"dedup.py failed on {names}: {tail(proc.stderr or proc.stdout)}")
        data = json.loads(report.read_text())
    return {k: data.get(k) for k in ("du_bytes_before", "du_bytes_after", "saved_bytes")}


def move_into_place(temp: Path, final: Path) -> None:
    """Rename the finished venv to its final name, replacing an older one only now."""
    if not final.exists():
        os.rename(temp, final)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
    old.rmdir()
    os.rename(final, old)
    os.rename(temp, final)
    shutil.rmtree(old)


def build_one(uv: str, name: str, opts: Options, skeleton: bool = False) -> Path:
    """Build ``<prefix>/<name>``; on any failure nothing is left under the prefix.

    ``skeleton``: all but the backend's own distribution, recorded in ep-skeleton.json (the
    image's shared layer; ``complete_one`` finishes it).
    """
    with building(opts.prefix, name):
        return _build_one(uv, name, opts, skeleton)


def _build_one(uv: str, name: str, opts: Options, skeleton: bool) -> Path:
    backend = ep_backends.get_backend(name, opts.project, opts.variant)
    skip = skeleton_skip(opts, backend) if skeleton else opts.no_install_packages
    for stale in stale_temp_dirs(opts.prefix, name):
        print(f"make_venv: removing {stale} left by an interrupted build", flush=True)
        shutil.rmtree(stale)
    temp = new_temp_dir(opts.prefix, name)
    try:
        create_venv(uv, temp, opts.python, opts.project)
        nvshmem_build = sync_backend(uv, temp, backend, opts.project, skip, te=bool(opts.te_wheels))
        shutil.rmtree(temp / source_build.SCRATCH, ignore_errors=True)
        install_te(uv, temp, opts.te_wheels)
        install_project(uv, temp, opts.project)
        if opts.compile_bytecode:
            compile_bytecode(temp)
        dedup = dedup_venvs(temp) if opts.dedup and not skeleton else None
        installed = installed_distributions(uv, temp)
        present = verify_backend(temp, backend, installed)
        checked = [*TE_DISTRIBUTIONS, *([] if skeleton else [backend.distribution])]
        abi_results = check_abi(temp, checked, strict=not opts.no_install_packages)
        assert_relocated(temp, temp.name)
        info = build_info(
            uv, temp, backend, opts, installed, present, nvshmem_build,
            skipped=[TE_DISTRIBUTION, *skip],
        )  # fmt: skip
        info["dedup"] = dedup
        info["abi"] = abi_results
        write_json(temp / (SKELETON_FILE if skeleton else INFO_FILE), info)
        final = opts.prefix / name
        move_into_place(temp, final)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    print_summary(final, info)
    return final


def skeleton_skip(opts: Options, backend: ep_backends.Backend) -> list[str]:
    """What a skeleton leaves out: the skip list, and the backend's own distribution."""
    return [*opts.no_install_packages, backend.distribution]


def python_sources(root: Path) -> dict[str, tuple[int, int, int]]:
    """relative path -> (inode, size, mtime_ns) of every ``.py`` file under ``root``."""
    state = {}
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            if name.endswith(".py"):
                st = os.lstat(os.path.join(dirpath, name))
                rel = os.path.relpath(os.path.join(dirpath, name), root)
                state[rel] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return state


def complete_one(uv: str, name: str, opts: Options) -> Path:
    """Install the backend's own distribution into its skeleton ``<prefix>/<name>``, in place.

    Why in place: the image's ep-<backend> stage sits on the layer holding every skeleton; a
    temporary copy renamed into place would put the whole venv into this stage's layer again.
    The stage's RUN is the unit of atomicity there (a failed RUN leaves no layer); elsewhere
    a failure leaves ep-skeleton.json and no ep-backend.json, so nothing takes it for a venv.
    """
    with building(opts.prefix, name):
        return _complete_one(uv, name, opts)


def _complete_one(uv: str, name: str, opts: Options) -> Path:
    backend = ep_backends.get_backend(name, opts.project, opts.variant)
    venv = opts.prefix / name
    try:
        skeleton = json.loads((venv / SKELETON_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise BuildError(
            f"{name}: --complete needs the skeleton {venv / SKELETON_FILE} ({exc}); make it "
            f"with make_venv.py --skeleton (the Dockerfile's venvs-common stage)"
        ) from None
    wanted = [TE_DISTRIBUTION, *skeleton_skip(opts, backend)]
    made_from = {"lock_sha256": sha256_file(opts.project / "uv.lock"), "skipped_packages": wanted}
    differ = [k for k, v in made_from.items() if skeleton.get(k) != v]
    if differ:
        raise BuildError(
            f"{name}: the skeleton at {venv} was made from another {' and '.join(differ)} "
            f"({', '.join(f'{k}: {skeleton.get(k)} vs {made_from[k]}' for k in differ)}); "
            "make it again with make_venv.py --skeleton from this lock and skip list"
        )
    before = python_sources(venv) if opts.compile_bytecode else {}
    nvshmem_build = sync_backend(
        uv, venv, backend, opts.project, opts.no_install_packages,
        te=bool(skeleton.get("te_wheels")), inexact=True,
    )  # fmt: skip
    shutil.rmtree(venv / source_build.SCRATCH, ignore_errors=True)
    if opts.compile_bytecode:
        new = [r for r, st in python_sources(venv).items() if before.get(r) != st]
        compile_bytecode(venv, [venv / r for r in sorted(new)])
    installed = installed_distributions(uv, venv)
    present = verify_backend(venv, backend, installed)
    abi_results = check_abi(venv, [backend.distribution], strict=not opts.no_install_packages)
    info = build_info(uv, venv, backend, opts, installed, present, nvshmem_build)
    info["te_wheels"] = skeleton.get("te_wheels", [])
    info["dedup"] = None
    info["completed_from_skeleton"] = skeleton.get("created")
    info["abi"] = abi_results
    write_json(venv / INFO_FILE, info)
    (venv / SKELETON_FILE).unlink()
    print_summary(venv, info)
    return venv


def build_skeletons(uv: str, opts: Options) -> list[Path]:
    """``--skeleton``: every backend the project defines, without its own distribution,
    hardlinked together (one layer holds their shared files once). The record says which."""
    built, absent = [], {}
    for name in opts.backends:
        try:
            ep_backends.get_backend(name, opts.project, opts.variant)
        except ep_backends.RegistryError as exc:
            absent[name] = str(exc)  # a project defining fewer backends (a fork, a test)
            print(f"make_venv: {name}: no skeleton, the project lacks it: {exc}", flush=True)
            continue
        built.append(build_one(uv, name, opts, skeleton=True))
    if not built:
        raise BuildError(f"the project at {opts.project} defines none of {opts.backends}")
    record = {
        "skeletons": [venv.name for venv in built],
        "absent": absent,
        "lock_sha256": sha256_file(opts.project / "uv.lock"),
        "skipped_packages": opts.no_install_packages,
        "dedup": None,
    }
    if opts.dedup:
        record["dedup"] = dedup_venvs(*built)
        print(f"make_venv: skeletons deduplicated: {record['dedup']}", flush=True)
    write_json(opts.prefix / SKELETONS_RECORD, record)
    return built


def print_summary(venv: Path, info: dict) -> None:
    versions = {ep_backends.normalize(d["name"]): d["version"] for d in info["installed"]}
    dist = ep_backends.normalize(info["distribution"])
    print(f"make_venv: {venv}: backend {info['backend']} (extra {info['extra']})")
    print(f"make_venv:   {info['distribution']} {versions.get(dist, 'NOT INSTALLED')}")
    print(f"make_venv:   torch {versions.get('torch', 'not installed')}")
    te = versions.get(TE_DISTRIBUTION) or versions.get("transformer-engine-torch")
    print(f"make_venv:   transformer-engine {te or 'not installed (no --te-wheel)'}")
    print(f"make_venv:   {len(info['installed'])} distributions, lock {info['lock_sha256'][:12]}")


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
                "python3 -m ep_image.build.build_te"
            )


def recorded_te_wheels(record_path: Path, wheel_dir: Path) -> list[Path]:
    """The TE wheel ``record_path`` (a te-build.json) names, found in ``wheel_dir`` with that
    sha256; none when the record says TE was skipped.

    Why: the image's ep stages take the record by COPY (it keys buildah's cache on the wheel's
    hash) and the wheel through a bind mount of the te stage (keeping it out of their layers,
    hence out of a one-backend image). A mount that came up empty or from another TE build must
    fail the venv, not silently give it no TE or the wrong one.
    """
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError) as exc:
        raise BuildError(f"--te-record {record_path}: {exc}") from None
    beside = wheel_dir / "te-build.json"
    try:
        same = json.loads(beside.read_text()) == record
    except (OSError, ValueError):
        same = False
    if not same:
        raise BuildError(
            f"{wheel_dir} does not hold the TE build that {record_path} records ({beside} is "
            f"{'different' if beside.is_file() else 'missing'}): the te stage's output is not "
            "what this step was given. In an image build the builder did not mount the te "
            "stage; build again, and if it repeats, with --no-cache. On a host: pass the "
            "directory build_te.py --out wrote, which holds both"
        )
    if not record.get("wheel"):
        return []  # TE_BUILD=skip: the record says so, and why
    wheel = wheel_dir / str(record["wheel"])
    if not wheel.is_file() or sha256_file(wheel) != record.get("wheel_sha256"):
        raise BuildError(
            f"{wheel} is {'not the wheel' if wheel.is_file() else 'missing, but'} "
            f"{record_path} records (sha256 {record.get('wheel_sha256')}). Fix: rebuild TE "
            "with python3 -m ep_image.build.build_te --out DIR and pass that DIR"
        )
    return [wheel.resolve()]


def parse_args(argv: list[str] | None) -> Options:
    parser = argparse.ArgumentParser(
        prog="make_venv.py",
        description=(
            "Create <prefix>/<backend>, a venv holding one EP backend, from the committed "
            "uv.lock (uv sync --frozen --extra <backend>), plus Transformer Engine from a wheel "
            "built once by build_te.py. The venv is built under a temporary name and "
            "renamed into place when complete, with <venv>/ep-backend.json saying what it holds."
        ),
        epilog=(
            f"Backends: {ep_backends.valid_names_text()}. Exit codes: 0 built; 1 the build "
            "failed (nothing left behind); 2 bad usage (e.g. an unknown backend). Example: "
            "python3 -m ep_image.build.make_venv --backend deepep_v2 --prefix /opt/venvs "
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
            "with --te-wheel-dir: install exactly the wheel this te-build.json names (none if "
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
            "also skip this package (repeatable). For footprint estimates only, e.g. hybridep "
            "without its git-built deep-ep; ep-backend.json then says backend_installed=false"
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
            f"({SKELETON_FILE}), deduplicated across them with --dedup; backends the project "
            "lacks are skipped, and <prefix>/" + SKELETONS_RECORD + " says which"
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
        "--keep-going",
        action="store_true",
        help="with several backends, build the others when one fails (exit 1 at the end)",
    )
    args = parser.parse_args(argv)
    try:
        backends = ep_backends.expand_backends(args.backend)
    except ep_backends.UnknownBackendError as exc:
        parser.exit(EXIT_USAGE, f"make_venv.py: error: {exc}\n")
    if args.variant is not None:
        if len(backends) != 1:
            parser.exit(EXIT_USAGE, "make_venv.py: error: --variant takes exactly one --backend\n")
        try:
            ep_backends.get_backend(backends[0], args.project.resolve(), args.variant)
        except (ep_backends.UnknownBackendError, ep_backends.RegistryError) as exc:
            parser.exit(EXIT_USAGE, f"make_venv.py: error: {exc}\n")
    te_wheels = [w.resolve() for w in args.te_wheel]
    if args.te_record is not None:
        if args.te_wheel_dir is None:
            parser.exit(EXIT_USAGE, "make_venv.py: error: --te-record needs --te-wheel-dir\n")
        try:
            te_wheels += recorded_te_wheels(args.te_record, args.te_wheel_dir.resolve())
        except BuildError as exc:
            parser.exit(EXIT_BUILD_FAILED, f"make_venv: error: {exc}\n")
        if not te_wheels:
            print(f"make_venv: {args.te_record} records no TE wheel (TE skipped): no TE")
    elif args.te_wheel_dir is not None:
        found = sorted(args.te_wheel_dir.resolve().glob("transformer_engine-*.whl"))
        if not found:
            print(f"make_venv: no transformer_engine-*.whl in {args.te_wheel_dir}: no TE")
        te_wheels += found
    skip = [*args.no_install_package, *args.no_install_packages.replace(",", " ").split()]
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
        mode="skeleton" if args.skeleton else "complete" if args.complete else "venv",
    )


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    failed: list[str] = []
    try:
        check_inputs(opts)
        prepare_prefix(opts.prefix)
        uv = uv_executable()
        if opts.mode == "skeleton":
            build_skeletons(uv, opts)
            return 0
        for name in opts.backends:
            try:
                (complete_one if opts.mode == "complete" else build_one)(uv, name, opts)
            except BuildError as exc:
                print(f"make_venv: error: {exc}", file=sys.stderr)
                failed.append(name)
                if not opts.keep_going:
                    break
    except BuildError as exc:
        print(f"make_venv: error: {exc}", file=sys.stderr)
        return EXIT_BUILD_FAILED
    except KeyboardInterrupt:
        print(
            f"make_venv: interrupted; no half-built venv is left under {opts.prefix} (a venv "
            "being completed in place keeps its ep-skeleton.json: run --complete again)",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    if failed:
        print(
            f"make_venv: failed: {', '.join(failed)} (each error above names its fix)",
            file=sys.stderr,
        )
        return EXIT_BUILD_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
