"""Prebuilt wheels of a source-built backend: exported after a compile, taken only when they match.

Real uv, a real git source (the stand-in HybridEP of tests/fixtures/fake_hybridep.py, through a
mirror), real venvs: the first build compiles and exports its wheel with a record; a second
build on an empty uv cache takes that wheel instead of compiling, and installs exactly its
files; a changed build input (the arch list) or a wheel that is not the recorded one makes the
build compile again, naming what differed.
"""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from pathlib import Path

import fake_hybridep
import pytest
from _venv_helpers import site_packages
from test_make_venv import leftovers, make_venv
from test_source_build import fake_cuda

from ep_image import pins
from ep_image.build_steps._source_builds import nvshmem
from ep_image.build_steps.make_venv import backend_wheels
from ep_image.files.records import sha256_file

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None,
    reason="the stand-in HybridEP needs a C compiler (python3 scripts/bootstrap.py --tests)",
)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The stand-in HybridEP's mirror and project, and a CUDA home with the driver stubs."""
    root = tmp_path_factory.mktemp("prebuilt")
    version = pins.locked_versions(Path(__file__).resolve().parents[1], nvshmem.DISTRIBUTION)
    fake = fake_hybridep.make(root / "mirror", version.pop(), dict(os.environ))
    config = fake_hybridep.gitconfig(root / "gitconfig", f"file://{fake.bare}")
    return {"fake": fake, "config": config, "cuda": fake_cuda(root / "cuda"), "root": root}


def env_for(source: dict, cache: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "GIT_CONFIG_GLOBAL": str(source["config"]), "GIT_CONFIG_NOSYSTEM": "1"}
    env.update(CUDA_HOME=str(source["cuda"]), UV_CACHE_DIR=str(cache))
    env.update({"TORCH_CUDA_ARCH_LIST": "9.0", **extra})
    return env


def build(source: dict, prefix: Path, cache: Path, *flags: str | Path, **env: str):
    args = ("--backend", "hybridep", "--prefix", prefix, "--project", source["fake"].project)
    proc = make_venv(*args, *flags, env=env_for(source, cache, **env))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def exported(source: dict) -> Path:
    """The first build: compiled, its wheel exported beside its record."""
    root = source["root"]
    out = build(source, root / "first", root / "cache-first", "--export-wheels", root / "wheels")
    assert "exported deep_ep-" in out, out
    return root / "wheels"


def test_the_export_is_the_wheel_the_venv_was_installed_from(exported: Path, source: dict) -> None:
    record = json.loads((exported / "hybridep-wheel.json").read_text())
    wheel = exported / record["wheel"]
    assert wheel.is_file() and record["wheel_sha256"] == sha256_file(wheel)
    assert record["commit"] == source["fake"].commits["hybridep"]
    assert record["backend"] == "hybridep" and record["distribution"] == "deep-ep"
    assert set(record["build_inputs"]) == {"nvidia-nvshmem-cu13"}  # what the stand-in locks
    assert backend_wheels.installed_from(wheel, site_packages(source["root"] / "first/hybridep"))


def test_a_matching_wheel_is_installed_instead_of_compiling(
    exported: Path, source: dict, tmp_path: Path
) -> None:
    """An empty uv cache: had uv compiled, its clone and build would show in the output."""
    out = build(source, tmp_path / "venvs", tmp_path / "cache", "--prebuilt-wheels", exported)
    assert "using the prebuilt deep_ep-" in out, out
    assert "Building deep-ep" not in out and "Built deep-ep" not in out, out
    venv = tmp_path / "venvs" / "hybridep"
    record = json.loads((exported / "hybridep-wheel.json").read_text())
    assert backend_wheels.installed_from(exported / record["wheel"], site_packages(venv))
    info = json.loads((venv / "ep-backend.json").read_text())
    assert info["nvshmem_build"]["prebuilt"]["wheel_sha256"] == record["wheel_sha256"]
    assert info["nvshmem_build"]["extension"]["runpath"] == [nvshmem.RUNPATH]
    assert leftovers(tmp_path / "venvs") == []


def test_another_arch_list_compiles_and_says_why(
    exported: Path, source: dict, tmp_path: Path
) -> None:
    out = build(
        source, tmp_path / "venvs", tmp_path / "cache", "--prebuilt-wheels", exported,
        TORCH_CUDA_ARCH_LIST="10.0",
    )  # fmt: skip
    assert "hybridep: compiling; no prebuilt wheel in" in out, out
    assert "hybridep-wheel.json: build_key is" in out, out
    assert "Built deep-ep" in out, out


def test_a_wheel_that_is_not_the_recorded_one_is_refused(
    exported: Path, source: dict, tmp_path: Path
) -> None:
    wheels = tmp_path / "wheels"
    shutil.copytree(exported, wheels)
    record = json.loads((wheels / "hybridep-wheel.json").read_text())
    with zipfile.ZipFile(wheels / record["wheel"], "a") as wheel:
        wheel.writestr("deep_ep/planted.py", "raise SystemExit('not the recorded build')\n")
    out = build(source, tmp_path / "venvs", tmp_path / "cache", "--prebuilt-wheels", wheels)
    assert "is not the wheel it records (sha256 differs)" in out, out
    assert "Built deep-ep" in out, out
    assert not (site_packages(tmp_path / "venvs" / "hybridep") / "deep_ep" / "planted.py").exists()
