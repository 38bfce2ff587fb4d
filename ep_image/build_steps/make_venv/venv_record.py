"""A backend venv's record (ep-backend.json, or a skeleton's ep-skeleton.json) and what goes in it.

Why: use-ep, the probes and the image's steps trust a venv only through this record.
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from pathlib import Path

from ep_image import backends as ep_backends
from ep_image.build_steps._te_wheels import TE_DISTRIBUTION
from ep_image.build_steps._uv.run import BuildError
from ep_image.build_steps._venv.layout import SKELETON_RECORD, VENV_RECORD
from ep_image.files.records import sha256_file, write_json

#: The --skeleton run's record, in the prefix: which skeletons, from what, deduplicated.
SKELETONS_RECORD = "venvs-common.json"


def record_path(venv: Path, skeleton: bool = False) -> Path:
    """Where ``venv``'s record goes: a finished venv's, or a skeleton's."""
    return venv / (SKELETON_RECORD if skeleton else VENV_RECORD)


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
    project: Path,
    installed: list[dict[str, str]],
    backend_installed: bool,
    *,
    skipped: list[str],
    te_wheels: list[Path],
    bytecode: bool,
    nvshmem_build: dict[str, object] | None = None,
) -> dict[str, object]:
    """The content of ep-backend.json (and of a skeleton's ep-skeleton.json)."""
    return {
        "backend": backend.name,
        "extra": backend.extra,
        "module": ep_backends.spec(backend.name).module,
        "distribution": backend.distribution,
        "requirement": backend.requirement,
        "source": backend.source_label,
        "backend_installed": backend_installed,
        "marker_file": backend.marker_file,
        "lock_sha256": sha256_file(project / "uv.lock"),
        "pyproject_sha256": sha256_file(project / "pyproject.toml"),
        "python": python_version(venv),
        "uv": uv_version(uv),
        "skipped_packages": skipped,
        "te_wheels": [{"file": w.name, "sha256": sha256_file(w)} for w in te_wheels],
        "installed": installed,
        "pip_check": pip_check(uv, venv, project),
        "nvshmem_build": nvshmem_build,
        "relocatable": True,
        "bytecode": "checked-hash, paths relative to site-packages" if bytecode else None,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "created_by": "ep_image.build_steps.make_venv",
    }


def read_skeleton(name: str, venv: Path, project: Path, skipped: list[str]) -> dict:
    """The skeleton record of ``venv``, which must have been made from ``project``'s lock and
    the skip list ``skipped``; otherwise a BuildError naming the step that makes it again."""
    path = record_path(venv, skeleton=True)
    try:
        skeleton = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BuildError(
            f"{name}: --complete needs the skeleton {path} ({exc}); make it "
            f"with make_venv.py --skeleton (the Dockerfile's venvs-common stage)"
        ) from None
    made_from = {"lock_sha256": sha256_file(project / "uv.lock"), "skipped_packages": skipped}
    differ = [k for k, v in made_from.items() if skeleton.get(k) != v]
    if differ:
        raise BuildError(
            f"{name}: the skeleton at {venv} was made from another {' and '.join(differ)} "
            f"({', '.join(f'{k}: {skeleton.get(k)} vs {made_from[k]}' for k in differ)}); "
            "make it again with make_venv.py --skeleton from this lock and skip list"
        )
    return skeleton


def write_skeletons_record(
    prefix: Path,
    built: list[Path],
    absent: dict[str, str],
    project: Path,
    skipped: list[str],
    dedup: dict[str, object] | None,
) -> Path:
    """``<prefix>/venvs-common.json``: the skeletons made, the backends the project lacks."""
    record = {
        "skeletons": [venv.name for venv in built],
        "absent": absent,
        "lock_sha256": sha256_file(project / "uv.lock"),
        "skipped_packages": skipped,
        "dedup": dedup,
    }
    return write_json(prefix / SKELETONS_RECORD, record)


def print_summary(venv: Path, info: dict) -> None:
    """What the venv holds, in five lines."""
    versions = {ep_backends.normalize(d["name"]): d["version"] for d in info["installed"]}
    dist = ep_backends.normalize(info["distribution"])
    print(f"make_venv: {venv}: backend {info['backend']} (extra {info['extra']})")
    print(f"make_venv:   {info['distribution']} {versions.get(dist, 'NOT INSTALLED')}")
    print(f"make_venv:   torch {versions.get('torch', 'not installed')}")
    te = versions.get(TE_DISTRIBUTION) or versions.get("transformer-engine-torch")
    print(f"make_venv:   transformer-engine {te or 'not installed (no --te-wheel)'}")
    print(f"make_venv:   {len(info['installed'])} distributions, lock {info['lock_sha256'][:12]}")
