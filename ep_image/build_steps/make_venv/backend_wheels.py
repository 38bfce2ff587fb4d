"""Prebuilt wheels of the DeepEP source builds: exported after a compile, taken when they match.

Why: compiling DeepEP v1 or HybridEP takes many minutes of nvcc, and a CI cache or a bigger
machine can do it once. ``export`` copies the wheel uv built (the very file the venv was
installed from, found by content) beside a record of what it was built from; a later build
takes it only when that record equals its own inputs
(ep_image/build_steps/_source_builds/prebuilt.py), else it compiles.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import shutil
import zipfile
from pathlib import Path
from typing import Any

from ep_image import backends as ep_backends
from ep_image.build_steps._source_builds import prebuilt, uv_cache
from ep_image.build_steps._uv.run import BuildError, run
from ep_image.build_steps._venv.layout import site_packages
from ep_image.files.records import sha256_file, write_json
from ep_image.pins import git_source

RECORD_SUFFIX = prebuilt.BACKEND_RECORD_SUFFIX


def record_name(backend: ep_backends.Backend) -> str:
    """``<backend>-wheel.json``, or ``<variant extra>-wheel.json`` for a variant."""
    return f"{backend.extra}{RECORD_SUFFIX}"


def expected(
    backend: ep_backends.Backend, project: Path, key: dict[str, str | None]
) -> dict[str, Any]:
    """What a wheel of ``backend`` must have been built from to stand in for this build: the
    pinned commit of its extra, the locked versions of what it compiles against, the build key
    (arch list, CUDA home, nvcc, declared variables: _source_builds/uv_cache.py) and Python."""
    pyproject = ep_backends.read_pyproject(project)
    _url, commit = git_source(pyproject, backend.distribution, backend.extra)
    return {
        "backend": backend.name,
        "extra": backend.extra,
        "distribution": backend.distribution,
        "commit": commit,
        "build_inputs": prebuilt.locked_inputs(project, backend.distribution),
        "build_key": uv_cache.key_digest(key),
        "python_tag": prebuilt.python_tag(),
    }


def choose(
    directory: Path | None, backend: ep_backends.Backend, wanted: dict[str, Any]
) -> prebuilt.Choice:
    return prebuilt.choose(directory, [record_name(backend)], wanted)


def install(uv: str, venv: Path, wheel: Path) -> None:
    """The prebuilt wheel, without dependencies (the lock's are already synced) and without the
    project's build settings (nothing is built)."""
    python = str(venv / "bin" / "python")
    run([uv, "pip", "install", "--no-config", "--no-deps", "--python", python, str(wheel)])


def _record_rows(wheel: zipfile.ZipFile) -> list[tuple[str, str]]:
    """(path, urlsafe-b64 sha256) of every file a wheel's RECORD hashes."""
    name = next(n for n in wheel.namelist() if n.endswith(".dist-info/RECORD"))
    rows = csv.reader(io.StringIO(wheel.read(name).decode()))
    return [(row[0], row[1].removeprefix("sha256=")) for row in rows if len(row) > 1 and row[1]]


def _file_b64(path: Path) -> str:
    with path.open("rb") as fh:
        digest = hashlib.file_digest(fh, "sha256").digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def installed_from(wheel_path: Path, site: Path) -> bool:
    """Whether every file ``wheel_path`` installs is byte-identical in ``site`` (dist-info
    excluded, which an installer rewrites)."""
    try:
        with zipfile.ZipFile(wheel_path) as wheel:
            rows = [(p, h) for p, h in _record_rows(wheel) if ".dist-info/" not in p]
    except (OSError, zipfile.BadZipFile, StopIteration):
        return False
    for rel, digest in rows:
        path = site / rel
        if not path.is_file() or _file_b64(path) != digest:
            return False
    return bool(rows)


def built_wheel(cache: Path, distribution: str, site: Path) -> Path:
    """The wheel in uv's cache that ``site`` was installed from (uv keeps each source build's
    wheel in its ``sdists`` bucket), matched by content, not by name: every git commit of
    deep-ep builds a wheel of the same name."""
    stem = distribution.replace("-", "_")
    for wheel in sorted(cache.glob(f"sdists-*/**/{stem}-*.whl")):
        if wheel.is_file() and installed_from(wheel, site):
            return wheel
    raise BuildError(
        f"no {stem}-*.whl in uv's cache {cache} holds what the venv installed: the build's wheel "
        "is not where uv keeps source builds (an older or newer uv, or a pruned cache). Fix: "
        "build again with the same UV_CACHE_DIR, then export"
    )


def export(
    uv: str,
    env: dict[str, str],
    venv: Path,
    backend: ep_backends.Backend,
    wanted: dict[str, Any],
    out: Path,
) -> Path:
    """Copy the wheel the venv was just built from into ``out``, with its record (``wanted``
    plus the wheel's name and sha256); returns the record's path."""
    cache = uv_cache.uv_cache_dir(uv, env)
    wheel = built_wheel(cache, backend.distribution, site_packages(venv))
    out.mkdir(parents=True, exist_ok=True)
    target = out / wheel.name
    partial = out / f".{wheel.name}.partial"
    shutil.copyfile(wheel, partial)
    partial.replace(target)
    record = {**wanted, "wheel": target.name, "wheel_sha256": sha256_file(target)}
    path = write_json(out / record_name(backend), record)
    print(f"make_venv: {backend.name}: exported {target.name} with {path.name} to {out}")
    return path
