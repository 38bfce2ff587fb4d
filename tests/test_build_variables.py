"""HybridEP's multi-node build variables: declared for uv, matching what setup.py reads, keyed.

Why these tests: HybridEP compiles its internode (RDMA) path only when its setup.py sees
``HYBRID_EP_MULTINODE`` set, and a build without it imports fine and fails only when ranks
span nodes. The variables therefore live in ``[tool.uv.extra-build-variables]``, so that a
plain ``uv sync --extra hybridep`` builds the multi-node variant too. These tests check:

- the declared names are ones setup.py at the pinned commit actually reads (a typo such as
  ``HYBRIDEP_MULTINODE`` would silently build the intranode-only variant), and their values
  select the intended branch of setup.py's parsing;
- the list recorded here is what setup.py reads, re-derived from the source itself when a
  DeepEP checkout is at hand (``EP_DEEPEP_GIT_DIR``; none in CI: GitHub is unreachable);
- with the real uv, declared variables reach a git-sourced build, override the environment,
  and a changed declared value rebuilds, while a changed *undeclared* environment variable
  silently reuses the cached wheel (the trap make_venv / the image must key around).
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECORD_PACKAGE = ROOT / "tests" / "fixtures" / "build_env_package"

#: The hybrid-ep commit the list below was read from (its setup.py, read 2026-12-02).
SETUP_PY_COMMIT = "e0a5b1d9848ab3e7b4a67842bf06f067bfac67f8"
#: Every environment variable that setup.py reads at that commit.
SETUP_PY_READS = {
    "HYBRID_EP_MULTINODE",  # "1" etc.: compile the internode path
    "USE_NIXL",  # with multinode: NIXL/UCX instead of the default DOCA/RDMA path
    "RDMA_CORE_HOME",  # DOCA path: <home>/include, <home>/lib for ibverbs and mlx5
    "DOCA_HOME",  # NIXL path only: extra include directory
    "NIXL_HOME",  # NIXL path only
    "UCX_HOME",  # NIXL path only
    "NVSHMEM_DIR",  # deep_ep_cpp (v1 kernels): else the nvidia-nvshmem wheel, else none
    "TORCH_CUDA_ARCH_LIST",  # HybridEP default 10.0 only; also NCCL's NVCC_GENCODE
    "DISABLE_SM90_FEATURES",  # A100 builds
    "DISABLE_AGGRESSIVE_PTX_INSTRS",
}
#: setup.py's truthy spellings for HYBRID_EP_MULTINODE and USE_NIXL.
SETUP_PY_TRUE = {"1", "true", "t", "yes", "y", "on"}


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.fixture(scope="module")
def declared(pyproject: dict) -> dict[str, str]:
    return pyproject["tool"]["uv"]["extra-build-variables"]["deep-ep"]


#: Declared for the tools rather than setup.py: torch 2.14.1's headers need C++20, the pinned
#: commit passes -std=c++17 to nvcc, and nvcc takes the last -std it is given; but NCCL's own
#: make (setup.py's multi-node branch) must not pass C++20 to nvcc, so GNU make empties it.
#: And for every DeepEP source build, read by torch's extension builder, gcc and setuptools: the
#: CUDA home (torch otherwise guesses it from the nvcc on PATH), CUDA 13's libcu++ for NVSHMEM's
#: headers, and a runpath to the venv's own NVSHMEM (setup.py's names uv's build environment).
COMPILER_READS = {
    "NVCC_APPEND_FLAGS": "-std=c++20",
    "MAKEFLAGS": "-l2 -- NVCC_APPEND_FLAGS=",
    "CUDA_HOME": "/usr/local/cuda",
    "CPATH": "/usr/local/cuda/include/cccl",
    "LDFLAGS": "-Wl,-rpath,$ORIGIN/nvidia/nvshmem/lib",
}


def test_declared_variables_select_the_doca_multinode_build(declared: dict[str, str]) -> None:
    for name, value in COMPILER_READS.items():
        assert declared.get(name) == value, name
    unknown = set(declared) - SETUP_PY_READS - set(COMPILER_READS)
    assert not unknown, f"setup.py does not read {unknown}: a typo builds intranode-only"
    assert declared["HYBRID_EP_MULTINODE"].strip().lower() in SETUP_PY_TRUE
    assert declared["USE_NIXL"].strip().lower() not in SETUP_PY_TRUE  # DOCA/RDMA path
    assert Path(declared["RDMA_CORE_HOME"]).is_absolute()
    assert all(isinstance(v, str) for v in declared.values())


def test_recorded_list_is_for_the_pinned_commit(pyproject: dict) -> None:
    """A new deep-ep pin must come with a fresh reading of its setup.py."""
    entries = pyproject["tool"]["uv"]["sources"]["deep-ep"]
    rev = next(e["rev"] for e in entries if e.get("extra") == "hybridep")
    assert rev == SETUP_PY_COMMIT, (
        f"deep-ep is pinned to {rev}; re-read its setup.py (EP_DEEPEP_GIT_DIR=<checkout> pytest "
        f"{Path(__file__).name}) and update SETUP_PY_READS and SETUP_PY_COMMIT"
    )


def env_names_read(source: str) -> set[str]:
    """Names passed as string literals to os.getenv / os.environ.get / os.environ[...]."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        target = None
        if isinstance(node, ast.Call) and node.args:
            func = ast.unparse(node.func)
            if func in ("os.getenv", "os.environ.get"):
                target = node.args[0]
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
            target = node.slice
        if isinstance(target, ast.Constant) and isinstance(target.value, str):
            names.add(target.value)
    return names


def test_recorded_list_matches_setup_py_source() -> None:
    git_dir = os.environ.get("EP_DEEPEP_GIT_DIR")
    if not git_dir:
        pytest.skip("set EP_DEEPEP_GIT_DIR to a DeepEP clone or mirror to re-read setup.py")
    source = subprocess.run(
        ["git", "-C", git_dir, "show", f"{SETUP_PY_COMMIT}:setup.py"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert env_names_read(source) == SETUP_PY_READS


@pytest.mark.skipif(
    shutil.which("make") is None,
    reason="GNU make absent here: python3 scripts/bootstrap.py --tests installs it",
)
def test_nccl_make_runs_without_the_cxx20_flag_the_extensions_get(
    declared: dict[str, str], tmp_path: Path
) -> None:
    """setup.py runs ``make -j src.build NVCC_GENCODE=...`` in third-party/nccl, which recurses
    into src/; on the H200, nvcc 13.0 failed NCCL 2.29.2's fp8 code under -std=c++20
    (docs/multinode.md). Every nvcc under make must see NVCC_APPEND_FLAGS empty, while a
    compiler setup.py starts itself (torch's extension build, through ninja) keeps the flag."""
    (tmp_path / "src").mkdir()
    (tmp_path / "Makefile").write_text(
        'src.build:\n\t@echo "top[$$NVCC_APPEND_FLAGS]"\n\t@$(MAKE) -C src build\n'
    )
    (tmp_path / "src" / "Makefile").write_text('build:\n\t@echo "sub[$$NVCC_APPEND_FLAGS]"\n')
    env = {**os.environ, **declared}
    gencode = "NVCC_GENCODE=-gencode=arch=compute_90,code=sm_90"
    make = subprocess.run(
        ["make", "-j", "src.build", gencode], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert make.returncode == 0, make.stderr
    assert "top[]" in make.stdout and "sub[]" in make.stdout, make.stdout
    direct = subprocess.run(
        ["sh", "-c", 'echo "[$NVCC_APPEND_FLAGS]"'], env=env, capture_output=True, text=True
    )
    assert direct.stdout.strip() == f"[{declared['NVCC_APPEND_FLAGS']}]" == "[-std=c++20]"


@pytest.mark.skipif(
    not Path("/usr/include/infiniband/verbs.h").exists(),
    reason="rdma-core headers absent here: apt-get install libibverbs-dev (.ci/run does)",
)
def test_rdma_core_home_holds_what_the_doca_path_compiles_against(
    declared: dict[str, str],
) -> None:
    home = Path(declared["RDMA_CORE_HOME"])
    assert (home / "include" / "infiniband" / "verbs.h").is_file()
    assert (home / "include" / "infiniband" / "mlx5dv.h").is_file()


# ---------------------------------------------------------------------------------------
# What uv does with build variables, measured with the real uv on a git source
# ---------------------------------------------------------------------------------------


def git(*args: str, cwd: Path) -> str:
    env = dict(os.environ, GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1")
    return subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, text=True, check=True, env=env, timeout=60
    ).stdout.strip()


def toml_inline(values: dict[str, str]) -> str:
    return "{ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in values.items()) + " }"


class Consumer:
    """A uv project depending on the recording package through a git source, as on deep-ep."""

    def __init__(self, tmp: Path, variables: dict[str, str]) -> None:
        src = tmp / "src"
        shutil.copytree(RECORD_PACKAGE, src)
        git("init", "-q", cwd=src)
        git("add", "-A", cwd=src)
        git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "record", cwd=src)
        self.commit = git("rev-parse", "HEAD", cwd=src)
        self.src = src
        self.dir = tmp / "consumer"
        self.dir.mkdir()
        self.cache = tmp / "uv-cache"
        self.write(variables)

    def write(self, variables: dict[str, str]) -> None:
        (self.dir / "pyproject.toml").write_text(
            "[project]\n"
            'name = "consumer"\nversion = "0"\nrequires-python = ">=3.11"\n'
            'dependencies = ["build-env-record"]\n'
            "[tool.uv]\npackage = false\n"
            "[tool.uv.sources]\n"
            f'build-env-record = {{ git = "{self.src.as_uri()}", rev = "{self.commit}" }}\n'
            "[tool.uv.extra-build-variables]\n"
            f"build-env-record = {toml_inline(variables)}\n"
        )

    def sync(self, *args: str, **env: str) -> dict:
        base = {k: v for k, v in os.environ.items() if not k.startswith("UV_")}
        base.update(
            UV_CACHE_DIR=str(self.cache),
            UV_PYTHON=sys.executable,
            UV_PYTHON_DOWNLOADS="never",
            GIT_CONFIG_GLOBAL=os.devnull,
        )
        for name in (
            "TORCH_CUDA_ARCH_LIST",
            "UNDECLARED",
            "HYBRID_EP_MULTINODE",
            "USE_NIXL",
            "NVCC_APPEND_FLAGS",
        ):
            base.pop(name, None)
        base.update(env)
        proc = subprocess.run(
            ["uv", "sync", "--offline", "-q", *args],
            cwd=self.dir,
            capture_output=True,
            text=True,
            env=base,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        found = list((self.dir / ".venv").glob("lib/python3*/site-packages/build_env_record.json"))
        assert len(found) == 1, found
        return json.loads(found[0].read_text())


def test_uv_passes_declared_variables_and_rebuilds_only_when_they_change(
    tmp_path: Path, declared: dict[str, str]
) -> None:
    # The project's real deep-ep declaration, plus an arch list to change later.
    variables = {**declared, "TORCH_CUDA_ARCH_LIST": "9.0;10.0"}
    consumer = Consumer(tmp_path, variables)

    first = consumer.sync(TORCH_CUDA_ARCH_LIST="8.0", UNDECLARED="a")
    for name, value in variables.items():
        assert first["env"][name] == value, name  # declared wins over the environment
    assert first["env"]["UNDECLARED"] == "a"  # undeclared variables reach the build too...

    # ...but uv does not key its cache on them: a different value reuses the old wheel.
    stale = consumer.sync("--reinstall-package", "build-env-record", UNDECLARED="b")
    assert stale["nonce"] == first["nonce"] and stale["env"]["UNDECLARED"] == "a"

    # A changed declared value is part of uv's build key: a plain sync rebuilds.
    consumer.write({**variables, "TORCH_CUDA_ARCH_LIST": "9.0"})
    rebuilt = consumer.sync()
    assert rebuilt["nonce"] != first["nonce"]
    assert rebuilt["env"]["TORCH_CUDA_ARCH_LIST"] == "9.0"

    # The way around the trap for environment inputs: drop the package's cached builds.
    subprocess.run(
        ["uv", "cache", "clean", "build-env-record"],
        env=dict(os.environ, UV_CACHE_DIR=str(consumer.cache)),
        capture_output=True,
        check=True,
        timeout=60,
    )
    fresh = consumer.sync("--reinstall-package", "build-env-record", UNDECLARED="c")
    assert fresh["nonce"] != rebuilt["nonce"] and fresh["env"]["UNDECLARED"] == "c"
