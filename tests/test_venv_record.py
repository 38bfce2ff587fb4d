"""ep_image/probes/_venv_record.py: a report names the venv it ran in and what came from outside it.

Real interpreters: a uv venv with a make_venv-style record, and a process that imports a module
and maps a shared object from a directory outside the venv (as a machine's own torch on
PYTHONPATH would be).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _venv_helpers import ROOT, make_uv_venv

PROBE = (
    "import json, sys; sys.path.insert(0, {root!r}); from ep_image.probes import _venv_record;"
    "{extra} print(json.dumps(_venv_record.environment_facts()))"
)


def facts(python: Path, extra: str = "", env: dict[str, str] | None = None) -> dict:
    code = PROBE.format(root=str(ROOT), extra=extra)
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True,
                         env=env).stdout  # fmt: skip
    return json.loads(out)


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = make_uv_venv(tmp_path_factory.mktemp("record") / "deepep_v2", python=sys.executable)
    record = {"backend": "deepep_v2", "extra": "deepep_v2", "lock_sha256": "ab" * 32,
              "skipped_packages": ["transformer-engine", "triton"], "abi": [{"ok": True}],
              "installed": [{"name": "torch", "version": "2.14.1"}]}  # fmt: skip
    (venv / "ep-backend.json").write_text(json.dumps(record))
    return venv


def test_the_record_of_the_venv_is_named(venv: Path) -> None:
    data = facts(venv / "bin" / "python")
    assert data["prefix"] == str(venv) and data["is_venv"] is True
    record = data["record"]
    assert record["lock_sha256"] == "ab" * 32 and record["extra"] == "deepep_v2"
    assert record["skipped_packages"] == ["transformer-engine", "triton"]
    assert record["abi_ok"] is True and "installed" not in record
    assert data["loaded_outside_venv"] == {"shared_objects": [], "modules": []}


def test_a_module_and_a_library_from_outside_the_venv_are_listed(
    venv: Path, tmp_path: Path
) -> None:
    """What a machine's own torch on PYTHONPATH would look like: both are named."""
    outside = tmp_path / "site-packages"
    (outside / "machine_torch").mkdir(parents=True)
    (outside / "machine_torch" / "__init__.py").write_text("")
    so = next(Path(sys.base_prefix).glob("lib/python3*/lib-dynload/_json*.so"), None)
    if so is None or shutil.which("cp") is None:
        pytest.skip("no extension module of the interpreter to copy")
    shutil.copy(so, outside / so.name)
    extra = (
        f"sys.path.insert(0, {str(outside)!r}); import machine_torch; import ctypes;"
        f"ctypes.CDLL({str(outside / so.name)!r});"
    )
    data = facts(venv / "bin" / "python", extra)
    loaded = data["loaded_outside_venv"]
    assert any(m.startswith("machine_torch: ") for m in loaded["modules"]), loaded
    assert str(outside / so.name) in loaded["shared_objects"], loaded


def test_a_python_without_a_record_says_so() -> None:
    """The test runner's own venv was not made by make_venv: no record, and the report says so."""
    data = facts(Path(sys.executable))
    assert data["record"] is None and data["prefix"] == sys.prefix


def test_the_interpreters_own_files_pass_and_a_distributions_package_beside_them_does_not(
    venv: Path,
) -> None:
    """The base interpreter's standard library, reached through a link (Debian's
    sitecustomize.py links into /etc), is the interpreter's; a package from a dist-packages or
    site-packages directory under the same prefix (a distribution's numpy on PYTHONPATH) is
    not, though both sit under the interpreter's prefix."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    hooks = [p for p in (stdlib / "sitecustomize.py",) if p.is_symlink()]
    site = next(
        (
            d
            for d in (*Path(sys.base_prefix).glob("lib/python3*/site-packages"),
                      *Path(sys.base_prefix).glob("lib/python3/dist-packages"))
            if any(d.glob("*.py")) or any(p.is_dir() and (p / "__init__.py").exists()
                                          for p in d.iterdir())
        ),
        None,
    )  # fmt: skip
    if site is None:
        pytest.skip("the interpreter's prefix has no populated site directory")
    package = next(
        p.stem if p.suffix == ".py" else p.name
        for p in sorted(site.iterdir())
        if (p.suffix == ".py" and p.stem.isidentifier() and not p.stem.startswith("_"))
        or (p.is_dir() and (p / "__init__.py").is_file() and p.name.isidentifier())
    )
    extra = f"sys.path.append({str(site)!r}); import {package};" + "".join(
        f" import {h.stem};" for h in hooks
    )
    loaded = facts(venv / "bin" / "python", extra)["loaded_outside_venv"]
    assert any(m.startswith(f"{package}: {site}") for m in loaded["modules"]), loaded
    assert not [m for m in loaded["modules"] if m.startswith("sitecustomize:")], loaded


def test_an_image_venv_names_its_image(venv: Path, tmp_path: Path) -> None:
    """In an image, the venvs' prefix holds the image's record (image.json): the report repeats
    it with the reference the container was started as (EP_IMAGE_REF); elsewhere image is null."""
    assert facts(venv / "bin" / "python")["image"] is None
    record = {"ep": "all", "backends": ["deepep_v1", "deepep_v2"], "active": "deepep_v2",
              "lock_sha256": ["cd" * 32], "switch": "use-ep"}  # fmt: skip
    (venv.parent / "image.json").write_text(json.dumps(record))
    try:
        env = {"PATH": "/usr/bin:/bin", "EP_IMAGE_REF": "localhost/ep-image:all@sha256:" + "e" * 64}
        image = facts(venv / "bin" / "python", env=env)["image"]
        assert image["ref"] == env["EP_IMAGE_REF"]
        assert image["record"] == {
            k: record[k] for k in ("ep", "backends", "active", "lock_sha256")
        }
        assert image["file"] == str(venv.parent / "image.json")
        assert facts(venv / "bin" / "python")["image"]["ref"] is None
    finally:
        (venv.parent / "image.json").unlink()
