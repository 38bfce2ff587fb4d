"""ep_image/build_steps/_source_builds/ (toolchain, uv_cache): a backend's source build is
checked first, links NVML, and is keyed.

Why these tests: HybridEP's multi-node build needs rdma-core headers and links
``libnvidia-ml.so.1`` (absent on a build machine without a driver); without the checks it fails
minutes into the compile. And uv reuses a cached wheel when only the environment changed
(TORCH_CUDA_ARCH_LIST, another nvcc), so the key must make it rebuild: shown here with the real
uv and a package whose build records its environment.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from test_build_variables import Consumer

from ep_image.build_steps._source_builds import toolchain, uv_cache

ROOT = Path(__file__).resolve().parents[1]
NVCC = "#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n"


def fake_cuda(root: Path, stub: bool = True, release: str = "13.0") -> Path:
    """A CUDA home with an nvcc that prints its release, and (``stub``) the driver stubs."""
    (root / "bin").mkdir(parents=True)
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text(NVCC.replace("13.0", release))
    nvcc.chmod(0o755)
    if stub:
        stubs = root / "lib64" / "stubs"
        stubs.mkdir(parents=True)
        compile_shared(stubs / "libnvidia-ml.so", "int nvmlInit_v2(void){return 0;}")
        compile_shared(stubs / "libcuda.so", "int cuInit(unsigned f){return 0;}")
    return root


def compile_shared(out: Path, source: str, *args: str) -> None:
    if not shutil.which("gcc"):
        pytest.skip(
            "gcc not installed (python3 -m ep_image.build_steps.bootstrap --tests installs it)"
        )
    src = out.with_suffix(".c")
    src.write_text(source + "\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(out), str(src), *args], check=True)


def rdma_home(root: Path, headers: tuple[str, ...] = toolchain.RDMA_HEADERS) -> Path:
    for header in headers:
        (root / "include" / header).parent.mkdir(parents=True, exist_ok=True)
        (root / "include" / header).write_text("/* rdma-core */\n")
    return root


MULTINODE = {"HYBRID_EP_MULTINODE": "1", "USE_NIXL": "0"}


def test_the_projects_declared_variables_select_the_multinode_doca_build() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    variables = toolchain.declared_variables(pyproject, "deep-ep")
    assert toolchain.multinode_doca(variables)
    assert not toolchain.multinode_doca({**variables, "USE_NIXL": "1"})
    assert not toolchain.multinode_doca({})


def test_preflight_names_missing_rdma_headers_and_nvcc(tmp_path: Path) -> None:
    cuda = fake_cuda(tmp_path / "cuda")
    rdma = rdma_home(tmp_path / "rdma", headers=("infiniband/verbs.h",))
    variables = {**MULTINODE, "RDMA_CORE_HOME": str(rdma)}
    problems = toolchain.preflight(variables, {"CUDA_HOME": str(cuda)})
    assert len(problems) == 1 and "infiniband/mlx5dv.h" in problems[0], problems
    assert "apt-get install libibverbs-dev" in problems[0]

    rdma_home(rdma)
    assert toolchain.preflight(variables, {"CUDA_HOME": str(cuda)}) == []

    problems = toolchain.preflight(variables, {"CUDA_HOME": str(tmp_path / "none")})
    assert any("no nvcc" in p and "CUDA_HOME" in p for p in problems), problems
    assert any("libnvidia-ml.so.1" in p for p in problems), problems
    assert any("links libcuda.so" in p and "stubs" in p for p in problems), problems
    # Without the multi-node variables (DeepEP v1, v2): nvcc and -lcuda only.
    assert toolchain.preflight({}, {"CUDA_HOME": str(cuda)}) == []
    problems = toolchain.preflight({}, {"CUDA_HOME": str(tmp_path / "none")})
    assert len(problems) == 2 and "no nvcc" in problems[0] and "libcuda.so" in problems[1]


def test_the_driver_stubs_let_the_linker_resolve_lcuda_and_libnvidia_ml_so_1(
    tmp_path: Path,
) -> None:
    """What setup.py's ``-lcuda`` and ``-l:libnvidia-ml.so.1`` need on a machine without a
    driver: without the stub links the real linker fails; with the LIBRARY_PATH link_stubs
    returns it links, and the result names the driver's sonames' files."""
    cuda = fake_cuda(tmp_path / "cuda")
    env = {"CUDA_HOME": str(cuda), "LIBRARY_PATH": ""}
    source = "int nvmlInit_v2(void); int cuInit(unsigned);"
    source += "int probe(void){return nvmlInit_v2() + cuInit(0);}"
    flags = ("-l:libnvidia-ml.so.1", "-lcuda", "-Wl,-z,defs")
    with pytest.raises(subprocess.CalledProcessError):
        compile_shared(tmp_path / "without.so", source, *flags)
    names = toolchain.driver_links(MULTINODE)
    assert names == (toolchain.CUDA_LINK, toolchain.NVML)
    assert toolchain.driver_links({}) == (toolchain.CUDA_LINK,)
    extra = toolchain.link_stubs(env, tmp_path / "scratch", names)
    assert extra["LIBRARY_PATH"].split(os.pathsep)[0] == str(tmp_path / "scratch")
    gcc_env = {**os.environ, **extra}
    src = tmp_path / "with.c"
    src.write_text(source + "\n")
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-o", str(tmp_path / "with.so"), str(src), *flags],
        check=True, env=gcc_env,
    )  # fmt: skip
    dynamic = subprocess.run(
        ["readelf", "-d", str(tmp_path / "with.so")], capture_output=True, text=True, check=True
    ).stdout
    assert "[libnvidia-ml.so.1]" in dynamic and "[libcuda.so]" in dynamic
    # The driver's libraries already on the link path: no stub.
    on_path = {**env, "LIBRARY_PATH": str(tmp_path / "scratch")}
    assert toolchain.link_stubs(on_path, tmp_path / "x", names) == {}


def test_build_key_follows_the_arch_list_and_the_nvcc_release(tmp_path: Path) -> None:
    cuda = fake_cuda(tmp_path / "cuda", stub=False)
    env = {"CUDA_HOME": str(cuda), "TORCH_CUDA_ARCH_LIST": "9.0"}
    key = uv_cache.build_key(env, MULTINODE)
    assert key["nvcc"] == "Cuda compilation tools, release 13.0, V13.0.88"
    assert key["declared:HYBRID_EP_MULTINODE"] == "1"
    digest = uv_cache.key_digest(key)
    assert digest == uv_cache.key_digest(uv_cache.build_key(dict(env), MULTINODE))
    other_arch = uv_cache.build_key({**env, "TORCH_CUDA_ARCH_LIST": "9.0;10.0"}, MULTINODE)
    assert uv_cache.key_digest(other_arch) != digest
    (cuda / "bin" / "nvcc").write_text(NVCC.replace("13.0", "13.1"))
    assert uv_cache.key_digest(uv_cache.build_key(env, MULTINODE)) != digest
    # The venv-derived paths make_venv sets are not part of it (they change every build).
    noisy = {**env, "NVSHMEM_DIR": "/p/.hybridep.tmp-1/x", "LDFLAGS": "-L/p/.hybridep.tmp-1"}
    assert uv_cache.key_digest(uv_cache.build_key(noisy, MULTINODE)) != digest  # nvcc
    (cuda / "bin" / "nvcc").write_text(NVCC)
    assert uv_cache.key_digest(uv_cache.build_key(noisy, MULTINODE)) == digest


def test_a_changed_environment_input_rebuilds_through_the_real_uv(tmp_path: Path) -> None:
    """uv alone reuses the wheel when TORCH_CUDA_ARCH_LIST changes (test_build_variables.py);
    with refresh_cache keyed on it, the next build runs again and sees the new value."""
    if not shutil.which("uv"):
        pytest.skip("uv not on PATH")
    consumer = Consumer(tmp_path, MULTINODE)
    distribution = "build-env-record"
    uv_env = {**os.environ, "UV_CACHE_DIR": str(consumer.cache)}

    def key(arch: str) -> dict[str, str | None]:
        return uv_cache.build_key({"TORCH_CUDA_ARCH_LIST": arch}, MULTINODE)

    assert uv_cache.refresh_cache("uv", distribution, key("9.0"), uv_env) == "first"
    first = consumer.sync(TORCH_CUDA_ARCH_LIST="9.0")
    assert first["env"]["TORCH_CUDA_ARCH_LIST"] == "9.0"

    assert uv_cache.refresh_cache("uv", distribution, key("9.0"), uv_env) == "unchanged"
    again = consumer.sync("--reinstall-package", distribution, TORCH_CUDA_ARCH_LIST="9.0")
    assert again["nonce"] == first["nonce"]  # the cached wheel, rightly

    assert uv_cache.refresh_cache("uv", distribution, key("10.0"), uv_env) == "changed"
    rebuilt = consumer.sync("--reinstall-package", distribution, TORCH_CUDA_ARCH_LIST="10.0")
    assert rebuilt["nonce"] != first["nonce"]
    assert rebuilt["env"]["TORCH_CUDA_ARCH_LIST"] == "10.0"
    record = consumer.cache / f"{uv_cache.KEY_PREFIX}{distribution}.json"
    assert '"TORCH_CUDA_ARCH_LIST": "10.0"' in record.read_text()


@pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")
def test_a_bare_make_j_is_bounded_by_max_jobs(tmp_path: Path) -> None:
    """HybridEP's multi-node setup.py runs NCCL's `make -j src.build`: unbounded, it used up a
    2-core build machine's memory. Through the wrapper the same command runs -j<MAX_JOBS>, and
    every other argument (one with a space included) reaches make unchanged."""
    work = tmp_path / "dir with space"
    work.mkdir()
    (work / "Makefile").write_text('all:\n\t@echo "[$(MAKEFLAGS)] [$(WHO)]"\n')
    env = {"PATH": os.environ["PATH"], "MAX_JOBS": "3"}
    plain = subprocess.run(["make", "-C", str(work), "-j", "all", "WHO=a b"], capture_output=True,
                           text=True, check=True, env=env).stdout  # fmt: skip
    assert re.search(r"\[\w* -j( --|\])", plain), plain  # a bare -j: unbounded
    extra = toolchain.bounded_make(env, tmp_path / "scratch")
    assert extra["EP_MAKE_JOBS"] == "3" and extra["PATH"].startswith(str(tmp_path / "scratch"))
    out = subprocess.run(["make", "-C", str(work), "-j", "all", "WHO=a b"], capture_output=True,
                         text=True, check=True, env={**env, **extra}).stdout  # fmt: skip
    assert "-j3 --jobserver-auth" in out and "[a b]" in out, out
    assert " -l" not in out.split("--jobserver-auth")[0], out  # the declared load bound lifted
    assert toolchain.bounded_make({**env, "MAX_JOBS": "x"}, tmp_path / "s2")["EP_MAKE_JOBS"] == str(
        os.cpu_count()
    )


def _busy_makefile(work: Path, jobs: int) -> Path:
    """A Makefile of ``jobs`` targets, each busy on a CPU for 2 s, logging its start and end."""
    work.mkdir(parents=True, exist_ok=True)
    rules = [f"all: {' '.join(f't{i}' for i in range(jobs))}"]
    for i in range(jobs):
        rules.append(
            f"t{i}:\n\t@echo start $$(date +%s.%N) >> log; "
            "timeout 2 sh -c 'while :; do :; done'; echo end $$(date +%s.%N) >> log"
        )
    (work / "Makefile").write_text("\n".join(rules) + "\n")
    return work


def _most_at_once(log: Path) -> int:
    events = sorted(
        (float(t), 1 if kind == "start" else -1)
        for kind, t in (line.split() for line in log.read_text().splitlines())
    )
    now = most = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


@pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")
def test_the_declared_makeflags_bound_a_bare_make_j_by_load(tmp_path: Path) -> None:
    """A plain `uv sync --extra hybridep` hands setup.py's `make -j src.build` the declared
    MAKEFLAGS, and no wrapper: its load bound keeps the bare -j from starting every job at once
    (the load reached 130 on a 2-core machine). Unbounded, the same make starts all 24."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["uv"][
        "extra-build-variables"
    ]["deep-ep"]["MAKEFLAGS"]
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS")}
    unbounded = _busy_makefile(tmp_path / "unbounded", 24)
    subprocess.run(["make", "-C", str(unbounded), "-j", "all"], env=env, check=True,
                   capture_output=True, timeout=300)  # fmt: skip
    assert _most_at_once(unbounded / "log") == 24
    bounded = _busy_makefile(tmp_path / "bounded", 24)
    subprocess.run(["make", "-C", str(bounded), "-j", "all"], env={**env, "MAKEFLAGS": declared},
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    assert _most_at_once(bounded / "log") <= 12, declared
