"""Installed files against their RECORD: a damaged uv cache or an edited distribution is named.

Real venvs made by uv: files truncated or edited after install (as a damaged cache entry
installs them), METADATA that claims another version, and make_venv building from a uv cache
whose copy of one wheel's file was cut short.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _venv_helpers import build_wheel, install, make_uv_venv, site_packages
from test_make_venv import leftovers, make_venv
from test_prebuilt_wheels import build, env_for, source  # noqa: F401  (source: a fixture)

from ep_image.build_steps import check_installed
from ep_image.build_steps._venv import dist_records


@pytest.fixture
def venv(tmp_path: Path) -> Path:
    return make_uv_venv(tmp_path / "venv", "six==1.17.0", "packaging==26.4")


def test_an_untouched_venv_matches_its_records(venv: Path) -> None:
    assert dist_records.verify(site_packages(venv)) == []


def test_a_truncated_file_and_an_edited_metadata_are_named(venv: Path) -> None:
    site = site_packages(venv)
    six = site / "six.py"
    six.write_bytes(six.read_bytes()[:100])  # what a cut-short cache entry installs
    metadata = next(site.glob("packaging-*.dist-info")) / "METADATA"
    metadata.write_text(metadata.read_text().replace("Version: 26.4", "Version: 25.0"))
    problems = {(p.distribution, p.path) for p in dist_records.verify(site)}
    assert ("six", "six.py") in problems
    assert ("packaging", f"{metadata.parent.name}/METADATA") in problems


def test_check_installed_names_an_edited_distribution(venv: Path) -> None:
    """The record says packaging 26.4 was installed; its METADATA now says 25.0."""
    site = site_packages(venv)
    metadata = next(site.glob("packaging-*.dist-info")) / "METADATA"
    metadata.write_text(metadata.read_text().replace("Version: 26.4", "Version: 25.0"))
    (venv / "ep-backend.json").write_text(
        json.dumps({"installed": [{"name": "packaging", "version": "26.4"}]})
    )
    installed = check_installed.installed_distributions(site)
    said = check_installed.recorded_versions(venv, installed)
    assert said == [
        "packaging 25.0 is installed, but ep-backend.json records 26.4: rebuild the venv with "
        "make_venv"
    ]
    assert any("METADATA differs from its RECORD hash" in str(p) for p in dist_records.verify(site))


def test_the_check_installed_command_exits_1_on_an_edited_torch(venv: Path, tmp_path: Path) -> None:
    """The command as a user runs it, on a venv whose torch METADATA was edited to 2.13.0
    against a record of 2.14.1 (exit 0 and no mention before the RECORD check): exit 1, both
    the edit and the version named, and the last line the fix."""
    wheel = build_wheel(
        tmp_path / "wheels", "torch", "2.14.1", {"torch/__init__.py": "__version__ = '2.14.1'\n"}
    )
    install(venv, str(wheel))
    metadata = next(site_packages(venv).glob("torch-*.dist-info")) / "METADATA"
    metadata.write_text(metadata.read_text().replace("Version: 2.14.1", "Version: 2.13.0"))
    (venv / "ep-backend.json").write_text(
        json.dumps({"installed": [{"name": "torch", "version": "2.14.1"}]})
    )
    proc = subprocess.run(
        [sys.executable, "-m", "ep_image.build_steps.check_installed", "--venv", str(venv),
         "--backend", "deepep_v2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout
    assert "torch-2.14.1.dist-info/METADATA differs from its RECORD hash" in proc.stdout
    assert "torch 2.13.0 is installed, but ep-backend.json records 2.14.1" in proc.stdout
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("check_installed: fix: rebuild the venv from the lock"), last
    assert "scripts/make_venv.py --backend deepep_v2" in last and "Traceback" not in proc.stdout


def test_make_venv_refuses_a_venv_built_from_a_damaged_cache(
    source: dict,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The first build fills uv's cache; one file of a cached wheel is then cut short; the next
    build from that cache installs it cleanly, and make_venv refuses the venv naming the file,
    before it is moved into place."""
    cache = tmp_path / "cache"
    build(source, tmp_path / "first", cache)
    cached = sorted(cache.glob("archive-v0/*/nvidia/nvshmem/lib/libnvshmem_host.so.*"))
    assert cached, "the wheel's files are not where uv keeps them"
    cached[0].unlink()  # a new, damaged file (the first venv's hardlink keeps the good one)
    cached[0].write_bytes(b"\x7fELF" + b"\0" * 100)
    args = ("--backend", "hybridep", "--prefix", tmp_path / "second")
    proc = make_venv(*args, "--project", source["fake"].project, env=env_for(source, cache))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "are not what their distribution recorded" in proc.stderr
    assert "nvidia-nvshmem-cu13: nvidia/nvshmem/lib/libnvshmem_host.so" in proc.stderr
    assert not (tmp_path / "second" / "hybridep").exists()
    assert leftovers(tmp_path / "second") == []
