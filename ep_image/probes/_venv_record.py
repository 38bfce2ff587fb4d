"""Which venv a probe ran in and what the process loaded, for the report.

Why: a GPU result counts for a backend only when it ran in a venv that make_venv.py built
from uv.lock. The report names that venv's record (the lock's hash, the extra, what was left out)
and every shared object and Python module the process took from outside the venv and the system,
so a machine's own torch cannot stand in for the venv's unseen.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from pathlib import Path
from typing import Any

from ep_image import SOURCE_ROOT
from ep_image.probes import _mapped

#: The venv record make_venv.py writes (ep_image/build_steps/_venv/layout.py VENV_RECORD), and
#: a skeleton's.
RECORDS = ("ep-backend.json", "ep-skeleton.json")
#: Record fields a report repeats: what the venv was made from and what it leaves out.
RECORD_FIELDS = (
    "backend", "extra", "distribution", "source", "lock_sha256", "pyproject_sha256",
    "skipped_packages", "created", "created_by", "python", "uv",
)  # fmt: skip
#: Where the system's and the GPU driver's libraries live (not a Python environment).
SYSTEM_PREFIXES = (
    "/lib/", "/lib64/", "/usr/lib/", "/usr/lib64/", "/usr/local/cuda", "/usr/local/nvidia/",
)  # fmt: skip


#: What image.json (the image's own record, ep_image/build_steps/image_stage.py) a report repeats.
IMAGE_FIELDS = ("ep", "backends", "active", "lock_sha256")


def image_facts(prefix: str | None = None) -> dict[str, Any] | None:
    """The image the venv belongs to, when it is one of an image's venvs: the fields of the
    image's record beside the venvs (``<EP_PREFIX>/image.json``), and the reference it was run
    as. A container cannot see its image's id, so whoever starts it passes the reference it
    pulled or built (``-e EP_IMAGE_REF=name@digest``). None outside an image."""
    venvs = Path(os.environ.get("EP_PREFIX") or Path(prefix or sys.prefix).parent)
    record_file = venvs / "image.json"
    if not record_file.is_file():
        return None
    try:
        data = json.loads(record_file.read_text())
        record: dict[str, Any] = {k: data.get(k) for k in IMAGE_FIELDS}
    except (OSError, ValueError) as exc:
        record = {"error": str(exc)}
    return {"ref": os.environ.get("EP_IMAGE_REF") or None, "record": record,
            "file": str(record_file)}  # fmt: skip


def venv_record(prefix: str | None = None) -> dict[str, Any]:
    """The running interpreter's venv and the fields of its make_venv record (None: no record,
    i.e. not a venv this project built)."""
    root = Path(prefix or sys.prefix)
    found = next((root / name for name in RECORDS if (root / name).is_file()), None)
    record: dict[str, Any] | None = None
    if found is not None:
        try:
            data = json.loads(found.read_text())
            record = {k: data.get(k) for k in RECORD_FIELDS}
            record["file"] = found.name
            abi = data.get("abi") or []
            record["abi_ok"] = all(entry.get("ok") for entry in abi) if abi else None
        except (OSError, ValueError) as exc:
            record = {"file": found.name, "error": str(exc)}
    return {
        "python": sys.executable,
        "prefix": str(root),
        "is_venv": sys.prefix != sys.base_prefix,
        "record": record,
        "pythonpath": os.environ.get("PYTHONPATH", ""),
        "image": image_facts(prefix),
    }


def _mapped_objects() -> list[str]:
    """Every file the process has mapped (``/proc/self/maps``), once each."""
    try:
        return sorted(_mapped.parse_maps(Path("/proc/self/maps").read_text()))
    except OSError:
        return []


def _under(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _in_site_dir(path: str) -> bool:
    """Under a site-packages or dist-packages directory: a distribution, never the interpreter."""
    return "/site-packages/" in path or "/dist-packages/" in path


def _interpreter_dirs() -> list[str]:
    """The interpreter's own standard library (and its extension modules), as named and as
    resolved: a distribution's Python puts site hooks there (Debian's sitecustomize.py is a
    link into /etc), and those are the interpreter's, not something that shadows the venv."""
    paths = sysconfig.get_paths()
    named = {paths["stdlib"], paths["platstdlib"]}
    return sorted({os.path.abspath(d) for d in named} | {os.path.realpath(d) for d in named})


def loaded_outside(prefix: str | None = None, allowed: tuple[str, ...] = ()) -> dict[str, Any]:
    """What the process took from outside its venv: shared objects not under the venv (nor the
    system's library directories) and Python modules not under the venv (nor the interpreter's
    own standard library, the probes, or ``allowed``: e.g. an upstream test's own files). Both
    lists empty: everything came from the venv."""
    root = os.path.realpath(prefix or sys.prefix)
    venv_roots = [root, os.path.abspath(prefix or sys.prefix)]
    stdlib = _interpreter_dirs()
    # The interpreter's own libpython (a pyenv or standalone build keeps it in its prefix).
    libdir = [os.path.realpath(d) for d in [sysconfig.get_config_var("LIBDIR")] if d]
    here = [os.path.realpath(SOURCE_ROOT)]  # ep_image itself
    here += [os.path.realpath(p) for p in allowed]
    objects = []
    for path in _mapped_objects():
        real = os.path.realpath(path)
        if ".so" not in Path(path).name or _under(real, venv_roots):
            continue
        interpreter = _under(real, stdlib + libdir) and not _in_site_dir(real)
        if _in_site_dir(real) or not (real.startswith(SYSTEM_PREFIXES) or interpreter):
            objects.append(path)
    modules = []
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if not isinstance(file, str) or not os.path.isabs(file):
            continue  # built-in, or a pseudo-module (torch.classes names "_classes.py")
        real, named = os.path.realpath(file), os.path.abspath(file)
        if _under(real, venv_roots + here):
            continue
        if any(_under(p, stdlib) and not _in_site_dir(p) for p in (real, named)):
            continue  # the interpreter's own standard library and site hooks
        modules.append(f"{name}: {file}")
    return {"shared_objects": objects, "modules": sorted(modules)}


def _own_roots() -> list[str]:
    """What is not outside: the venv, the interpreter's standard library, ep_image."""
    paths = sysconfig.get_paths()
    roots = {sys.prefix, paths["stdlib"], paths["platstdlib"], str(SOURCE_ROOT / "ep_image")}
    return sorted({os.path.realpath(r) for r in roots} | {os.path.abspath(r) for r in roots})


def outside_venv(files: list[str]) -> list[str]:
    """Those of ``files`` (a traceback's, in its order) that lie outside the venv, its
    interpreter's standard library and ep_image: code that came from elsewhere."""
    roots = _own_roots()
    found: list[str] = []
    for file in files:
        real = os.path.realpath(file)
        if os.path.isabs(file) and not _under(real, roots) and file not in found:
            found.append(file)
    return found


def came_through(path: str) -> str:
    """How a file outside the venv got onto the import path: a PYTHONPATH entry, or else."""
    for entry in filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)):
        if _under(os.path.realpath(path), [os.path.realpath(entry)]):
            return f"through PYTHONPATH ({entry})"
    return "from outside the venv"


def shadowing_hint(path: str, raised: bool = True) -> str:
    """The fix for code imported from outside the venv that shadows the venv's own."""
    package = Path(path).parent if Path(path).name == "__init__.py" else Path(path)
    said = "and raised (the error above)" if raised else "instead of the venv's"
    return (
        f"{package} was imported {came_through(path)}, not from this venv ({sys.prefix}), "
        f"{said}: it shadows the venv's own; remove it from PYTHONPATH (or run with a clean "
        "environment, e.g. env -u PYTHONPATH), then run again"
    )


def environment_facts(prefix: str | None = None) -> dict[str, Any]:
    """The venv, its record, and what was loaded from outside it: one block for every report."""
    facts = venv_record(prefix)
    facts["loaded_outside_venv"] = loaded_outside(prefix)
    return facts
