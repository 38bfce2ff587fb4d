"""ep_image/build_steps/build_te/ against real venvs made with uv (no mocks).

What this proves: discovery finds the headers and libraries of the real nvidia-cudnn-cu13 wheel
the lock pins (site-packages/nvidia/cudnn/{include,lib}) and reads its version from
cudnn_version.h; a venv without that wheel gets an error naming the package and the fix;
``--dry-run`` prints the exact environment TE's build reads and the exact command; an incomplete
TE source tree (a snapshot without submodules) is refused with what is missing; ``--skip``
records that TE was not built.
What it does NOT prove: that TE compiles. That needs TE's full source with its submodules
(GitHub) and a CUDA toolkit, and takes hours on 2 cores: the image's `te` stage does it.

The cuDNN wheel is ~550 MB; uv's cache makes repeat installs a matter of seconds.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from _venv_helpers import build_wheel
from test_source_build import fake_cuda

from ep_image.build_steps._source_builds import prebuilt
from ep_image.build_steps._venv import cudnn as venv_cudnn
from ep_image.build_steps.build_te.environment import nvte_archs
from ep_image.build_steps.build_te.source import (
    BuildTeError,
    apply_links,
    check_pins,
    clone_pinned,
    pinned_commit,
    source_commit,
)
from ep_image.files.records import sha256_file

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "ep_image.build_steps.build_te"


def locked_version(name: str) -> str:
    """The version uv.lock pins for ``name`` (the test follows the lock, not a copy of it)."""
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    versions = {p["version"] for p in lock["package"] if p["name"] == name}
    assert len(versions) == 1, f"{name}: {versions}"
    return versions.pop()


def make_venv(path: Path, *requirements: str) -> Path:
    """A throwaway venv with ``requirements`` installed by uv (no dependencies)."""
    subprocess.run(["uv", "venv", "--quiet", str(path)], check=True)
    if requirements:
        python = str(path / "bin" / "python")
        subprocess.run(
            ["uv", "pip", "install", "--quiet", "--no-deps", "--python", python, *requirements],
            check=True,
            timeout=900,
        )
    return path


def run_script(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", SCRIPT, *map(str, args)],
        capture_output=True,
        text=True,
        check=False,
    )


def te_source_snapshot(path: Path) -> Path:
    """The top of a TE source tree as a plain snapshot has it: no submodules under 3rdparty/."""
    (path / "build_tools").mkdir(parents=True)
    (path / "build_tools" / "VERSION.txt").write_text("2.17.0\n")
    (path / "setup.py").write_text("raise SystemExit('not a real TE tree')\n")
    for sub in ("cudnn-frontend", "cutlass", "googletest", "nccl"):
        (path / "3rdparty" / sub).mkdir(parents=True)  # uninitialised submodules are empty dirs
    return path


@pytest.fixture(scope="module")
def cudnn_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Venv with the lock's nvidia-cudnn-cu13 and nvidia-cudnn-frontend (the moe extra's)."""
    return make_venv(
        tmp_path_factory.mktemp("cudnn") / "venv",
        f"nvidia-cudnn-cu13=={locked_version('nvidia-cudnn-cu13')}",
        f"nvidia-cudnn-frontend=={locked_version('nvidia-cudnn-frontend')}",
    )


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_venv(tmp_path_factory.mktemp("bare") / "venv")


def parse_exports(stdout: str) -> dict[str, str]:
    env = {}
    for line in stdout.splitlines():
        if line.startswith("export "):
            key, _, value = line.removeprefix("export ").partition("=")
            env[key] = shlex.split(value)[0]
    return env


def test_discovery_finds_the_wheels_headers_libs_and_version(cudnn_venv: Path) -> None:
    cudnn = venv_cudnn.find_cudnn(cudnn_venv)
    site = next(cudnn_venv.glob("lib/python3*/site-packages"))
    assert cudnn.root == site / "nvidia" / "cudnn"
    assert (cudnn.include / "cudnn.h").is_file()
    assert (cudnn.lib / "libcudnn.so.9").is_file()
    assert (cudnn.lib / "libcudnn_graph.so.9").is_file()
    # The version comes from the header, and agrees with the wheel that installed it.
    dist = locked_version("nvidia-cudnn-cu13")
    assert cudnn.dist_version == dist
    assert cudnn.version == ".".join(dist.split(".")[:3])
    header = (cudnn.include / "cudnn_version.h").read_text()
    for macro, value in zip(
        ("MAJOR", "MINOR", "PATCHLEVEL"), cudnn.version.split("."), strict=True
    ):
        assert f"#define CUDNN_{macro} {value}" in header
    print(f"\ncuDNN {cudnn.version} (wheel {dist}): {cudnn.include} | {cudnn.lib}")


def test_venv_without_cudnn_names_the_package_and_the_fix(bare_venv: Path, tmp_path: Path) -> None:
    source = te_source_snapshot(tmp_path / "te")
    result = run_script(
        "--venv", bare_venv, "--source", source, "--out", tmp_path / "out", "--dry-run"
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "nvidia-cudnn-cu13 is not installed" in result.stderr
    assert "uv sync --frozen --extra moe" in result.stderr
    assert "Traceback" not in result.stderr
    print("\n" + result.stderr.strip())


def test_dry_run_prints_the_exact_environment_and_command(cudnn_venv: Path, tmp_path: Path) -> None:
    source = te_source_snapshot(tmp_path / "te")
    out = tmp_path / "out"
    result = run_script(
        "--venv", cudnn_venv, "--source", source, "--arch-list", "9.0;10.0",
        "--jobs", "3", "--out", out, "--dry-run",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    print("\n" + result.stdout)
    env = parse_exports(result.stdout)
    cudnn = venv_cudnn.find_cudnn(cudnn_venv)
    assert env["CUDNN_PATH"] == env["CUDNN_HOME"] == str(cudnn.root)
    assert env["CUDNN_INCLUDE_PATH"] == str(cudnn.include)
    assert env["CUDNN_LIBRARY_PATH"] == str(cudnn.lib)
    # The venv's cuDNN comes first for the compiler, the linker and the loader.
    assert env["CPATH"].split(os.pathsep)[0] == str(cudnn.include)
    assert env["LIBRARY_PATH"].split(os.pathsep)[0] == str(cudnn.lib)
    assert env["LD_LIBRARY_PATH"].split(os.pathsep)[0] == str(cudnn.lib)
    assert env["PATH"].split(os.pathsep)[0] == str(cudnn_venv / "bin")
    assert env["NVTE_FRAMEWORK"] == "pytorch"
    assert env["NVTE_CUDA_ARCHS"] == "90;100"
    assert env["TORCH_CUDA_ARCH_LIST"] == "9.0;10.0"
    assert env["MAX_JOBS"] == "3"
    assert env["NVTE_BUILD_THREADS_PER_JOB"] == "1"
    expected = shlex.join(
        ["uv", "build", "--wheel", "--no-build-isolation", "--python",
         str(cudnn_venv / "bin" / "python"), "--out-dir", str(out), str(source)]
    )  # fmt: skip
    assert expected in result.stdout.splitlines()
    # The snapshot has no submodules: the frontend headers come from the venv's wheel, the
    # rest is named as missing.
    site = next(cudnn_venv.glob("lib/python3*/site-packages"))
    assert f"# will link 3rdparty/cudnn-frontend/include -> {site / 'include'}" in result.stdout
    assert "# MISSING in source: 3rdparty/cutlass/include (submodule)" in result.stdout
    assert "3rdparty/cudnn-frontend/cmake/cuDNN.cmake" in result.stdout
    assert "3rdparty/nccl" in result.stdout  # NCCL EP: archs >= 9.0 selected
    assert "# MISSING in venv: torch" in result.stdout
    # A dry run changes nothing.
    assert not out.exists()
    assert not (source / "3rdparty" / "cudnn-frontend" / "include").exists()


def test_nccl_ep_off_drops_the_nccl_submodule_requirement(cudnn_venv: Path, tmp_path: Path) -> None:
    source = te_source_snapshot(tmp_path / "te")
    env = {**os.environ, "NVTE_WITH_NCCL_EP": "0"}
    result = subprocess.run(
        [sys.executable, "-m", SCRIPT, "--venv", str(cudnn_venv), "--source", str(source),
         "--out", str(tmp_path / "out"), "--dry-run"],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "3rdparty/nccl" not in result.stdout


def test_build_refuses_an_incomplete_source_and_says_what_is_missing(
    cudnn_venv: Path, tmp_path: Path
) -> None:
    source = te_source_snapshot(tmp_path / "te")
    result = run_script("--venv", cudnn_venv, "--source", source, "--out", tmp_path / "out")
    assert result.returncode == 1
    assert "the TE source tree lacks" in result.stderr
    assert "3rdparty/cutlass/include" in result.stderr
    assert "git -C SOURCE submodule update --init --recursive" in result.stderr
    assert not (tmp_path / "out" / "te-build.json").exists()


def test_not_a_te_tree_is_named(cudnn_venv: Path, tmp_path: Path) -> None:
    result = run_script("--venv", cudnn_venv, "--source", tmp_path, "--out", tmp_path / "o")
    assert result.returncode == 1
    assert "is not a TransformerEngine source tree" in result.stderr


def test_skip_records_that_te_was_not_built(tmp_path: Path) -> None:
    result = run_script("--skip", "CPU-only test", "--out", tmp_path)
    assert result.returncode == 0, result.stderr
    record = json.loads((tmp_path / "te-build.json").read_text())
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pin = pyproject["tool"]["uv"]["sources"]["transformer-engine"]["rev"]
    assert record["skipped"] is True
    assert record["reason"] == "CPU-only test"
    assert record["te_commit_pinned"] == pin
    assert not list(tmp_path.glob("*.whl"))


def test_a_link_left_by_an_earlier_build_is_replaced(tmp_path: Path) -> None:
    """An earlier run linked the frontend's headers into its throwaway venv, now gone: a rerun
    on the same source links again instead of failing with FileExistsError."""
    include = tmp_path / "te" / "3rdparty" / "cudnn-frontend" / "include"
    include.parent.mkdir(parents=True)
    include.symlink_to(tmp_path / "gone-venv" / "include", target_is_directory=True)
    headers = tmp_path / "venv" / "include"
    headers.mkdir(parents=True)
    apply_links(tmp_path / "te", {"3rdparty/cudnn-frontend/include": headers})
    assert include.is_symlink() and include.resolve() == headers.resolve()
    empty = tmp_path / "te" / "3rdparty" / "cutlass"
    empty.mkdir()  # an uninitialised submodule
    apply_links(tmp_path / "te", {"3rdparty/cutlass": headers})
    assert empty.is_symlink()


def test_arch_list_conversion_and_errors() -> None:
    assert nvte_archs("9.0;10.0") == "90;100"
    assert nvte_archs("9.0 10.0a") == "90;100a"
    with pytest.raises(BuildTeError, match="compute capabilities"):
        nvte_archs("sm_90")


def test_source_commit_must_match_the_pin() -> None:
    record = {"te_commit_pinned": "a" * 40, "te_commit_source": "b" * 40}
    with pytest.raises(BuildTeError, match=r"pyproject\.toml pins"):
        check_pins(record)
    check_pins({"te_commit_pinned": "a" * 40, "te_commit_source": None})


def fake_te_project(tmp_path: Path) -> tuple[Path, str]:
    """A bare git repository standing in for TransformerEngine, and a project pinning it."""
    work = tmp_path / "te-work"
    work.mkdir()
    (work / "setup.py").write_text("# stand-in\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@invalid"]
    subprocess.run([*git, "init", "-q", "-b", "main", str(work)], check=True)
    subprocess.run([*git, "-C", str(work), "add", "-A"], check=True)
    subprocess.run([*git, "-C", str(work), "commit", "-q", "-m", "te"], check=True)
    commit = subprocess.run(["git", "-C", str(work), "rev-parse", "HEAD"], capture_output=True,
                            text=True, check=True).stdout.strip()  # fmt: skip
    subprocess.run(["git", "clone", "-q", "--bare", str(work), str(tmp_path / "TE.git")],
                   check=True)  # fmt: skip
    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text(
        "[tool.uv.sources]\ntransformer-engine = { git = "
        f'"https://github.com/NVIDIA/TransformerEngine", rev = "{commit}" }}\n'
    )
    return project, commit


def test_clone_of_the_pin_goes_through_the_git_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The te stage's clone honours url.<mirror>.insteadOf (the image's gitconfig secret)."""
    project, commit = fake_te_project(tmp_path)
    config = tmp_path / "gitconfig"
    config.write_text(
        f'[url "file://{tmp_path}/TE.git"]\n\tinsteadOf = https://github.com/NVIDIA/TransformerEngine\n'
    )
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(config))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    dest = clone_pinned(project, tmp_path / "src")
    assert source_commit(dest) == commit
    config.write_text('[url "file:///nonexistent/"]\n\tinsteadOf = https://github.com/\n')
    with pytest.raises(BuildTeError, match="gitconfig secret"):
        clone_pinned(project, tmp_path / "src2")


# --- a prebuilt TE wheel (--prebuilt, the image's PREBUILT_WHEELS) ---------------------------


def prebuilt_dir(path: Path, **changes: object) -> Path:
    """A TE wheel and the te-build.json build_te would write for this lock and arch list 9.0,
    with ``changes`` applied to the record."""
    files = {"transformer_engine/__init__.py": ""}
    wheel = build_wheel(path, "transformer_engine", "2.17.0", files)
    tagged = wheel.with_name(f"transformer_engine-2.17.0-{prebuilt.python_tag()}-linux_x86_64.whl")
    wheel.rename(tagged)
    record = {
        "skipped": False,
        "te_commit": pinned_commit(ROOT),
        "torch_version": locked_version("torch"),
        "cudnn_dist_version": locked_version("nvidia-cudnn-cu13"),
        "cudnn_frontend_version": locked_version("nvidia-cudnn-frontend"),
        "arch_list": "9.0",
        "cuda_version": "13.0",
        "nccl_ep": False,
        "wheel": tagged.name,
        "wheel_sha256": sha256_file(tagged),
        **changes,
    }
    (path / "te-build.json").write_text(json.dumps(record))
    return path


def run_with_cuda(tmp_path: Path, *args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CUDA_HOME": str(fake_cuda(tmp_path / "cuda")), "NVTE_WITH_NCCL_EP": "0"}
    return subprocess.run(
        [sys.executable, "-m", SCRIPT, *map(str, args)],
        capture_output=True, text=True, check=False, env=env,
    )  # fmt: skip


def test_a_matching_prebuilt_wheel_is_taken_without_building(tmp_path: Path) -> None:
    """No venv, no source, no network: had it built, it would have tried to clone the pin."""
    wheels = prebuilt_dir(tmp_path / "wheels")
    out = tmp_path / "out"
    proc = run_with_cuda(tmp_path, "--prebuilt", wheels, "--arch-list", "9.0", "--out", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "using the prebuilt transformer_engine-2.17.0" in proc.stdout
    record = json.loads((out / "te-build.json").read_text())
    assert (out / record["wheel"]).read_bytes() == (wheels / record["wheel"]).read_bytes()
    assert record == json.loads((wheels / "te-build.json").read_text())


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"arch_list": "9.0;10.0"}, "arch_list is '9.0;10.0', this build's is '9.0'"),
        ({"torch_version": "2.13.0"}, "torch_version is '2.13.0'"),
        ({"cudnn_dist_version": "9.19.0.56"}, "cudnn_dist_version is '9.19.0.56'"),
        ({"te_commit": "0" * 40}, "te_commit is '0000"),
        ({"wheel_sha256": "0" * 64}, "is not the wheel it records (sha256 differs)"),
    ],
)
def test_a_prebuilt_wheel_that_differs_is_not_taken(
    tmp_path: Path, change: dict, named: str
) -> None:
    """It builds instead (here from a source tree that lacks its submodules: exit 1, after
    saying why the prebuilt wheel was not taken)."""
    wheels = prebuilt_dir(tmp_path / "wheels", **change)
    source = te_source_snapshot(tmp_path / "te")
    proc = run_with_cuda(
        tmp_path, "--prebuilt", wheels, "--arch-list", "9.0", "--venv", tmp_path / "no-venv",
        "--source", source, "--out", tmp_path / "out",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Transformer Engine: compiling; no prebuilt wheel in" in proc.stdout
    assert named in proc.stdout, proc.stdout
    assert not (tmp_path / "out" / "te-build.json").exists()
