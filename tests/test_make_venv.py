"""make_venv.py with real uv: a real backend venv from the lock, and its failure paths.

The deepep_v2 build installs torch 2.14.1 (CUDA build, ~5 GB) from uv's cache; the first run on
a machine downloads it. The HybridEP test proves the git-source failure is clean and names the
fix, on a machine that cannot reach GitHub *or* can: git is pointed at a mirror that does not
exist, and uv gets an empty cache so no earlier clone can stand in for the fetch.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import fake_hybridep
import pytest
from _venv_helpers import ROOT, SCRIPTS, build_wheel, site_packages
from test_source_build import fake_cuda

from ep_image import backends as ep_backends
from ep_image import pins
from ep_image.build_steps._source_builds import nvshmem, toolchain
from ep_image.build_steps._uv import pinned

MAKE_VENV = "ep_image.build_steps.make_venv"


def make_venv(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", MAKE_VENV, *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)


def leftovers(prefix: Path) -> list[Path]:
    return sorted(prefix.glob(".*")) if prefix.exists() else []


def test_unknown_backend_exits_2_and_lists_the_valid_ones(tmp_path: Path) -> None:
    proc = make_venv("--backend", "deepep_v3", "--prefix", tmp_path / "venvs")
    assert proc.returncode == 2
    for name in ep_backends.BACKEND_NAMES:
        assert name in proc.stderr
    assert "deepep_v3" in proc.stderr
    assert not (tmp_path / "venvs").exists()


def test_uv_missing_names_the_pinned_version(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": "/usr/bin:/bin", "XDG_CACHE_HOME": str(tmp_path)}
    if shutil.which("uv", path=env["PATH"]):
        pytest.skip("uv is installed system-wide here")
    proc = make_venv("--backend", "deepep_v2", "--prefix", tmp_path / "venvs", env=env)
    assert proc.returncode == 1
    assert (
        f"uv {pinned.UV_VERSION}" in proc.stderr and "python3 scripts/bootstrap.py" in proc.stderr
    )


def test_help_reads_like_documentation() -> None:
    proc = make_venv("--help")
    assert proc.returncode == 0
    for text in ("--backend", "--prefix", "--te-wheel", "uv.lock", "Exit codes"):
        assert text in proc.stdout


def test_te_record_takes_exactly_the_recorded_wheel_or_fails(tmp_path: Path) -> None:
    """The image's ep stages COPY te-build.json and mount the te stage's output: an empty or
    different mount must fail the venv, not give it no TE or another TE."""
    from ep_image.build_steps import make_venv as mv

    wheel = build_wheel(
        tmp_path / "te", "transformer_engine", "2.17.0", {"transformer_engine/__init__.py": ""}
    )
    record = {"wheel": wheel.name, "wheel_sha256": hashlib.sha256(wheel.read_bytes()).hexdigest()}
    (tmp_path / "te" / "te-build.json").write_text(json.dumps(record))
    copied = tmp_path / "copied-te-build.json"
    copied.write_text(json.dumps(record))
    args = ["--backend", "deepep_v2", "--prefix", tmp_path / "venvs"]
    route = ["--te-wheel-dir", tmp_path / "te", "--te-record", copied]
    build_wheel(
        tmp_path / "te", "transformer_engine", "2.16.0", {"transformer_engine/__init__.py": ""}
    )
    assert mv.parse_args([*map(str, args), *map(str, route)]).te_wheels == [wheel.resolve()]

    empty = tmp_path / "empty"  # what a bind mount that came up empty shows
    empty.mkdir()
    proc = make_venv(*args, "--te-wheel-dir", empty, "--te-record", copied)
    assert proc.returncode == 1 and "te-build.json is missing" in proc.stderr, proc.stderr
    assert "--no-cache" in proc.stderr and not (tmp_path / "venvs").exists()

    wheel.write_bytes(wheel.read_bytes() + b"\0")  # same name, other bytes
    proc = make_venv(*args, *route)
    assert proc.returncode == 1 and f"{wheel.name} is not the wheel" in proc.stderr, proc.stderr

    skipped = {"skipped": True, "reason": "TE_BUILD=skip"}
    for path in (tmp_path / "te" / "te-build.json", copied):
        path.write_text(json.dumps(skipped))
    assert mv.parse_args([*map(str, args), *map(str, route)]).te_wheels == []
    (tmp_path / "te" / "te-build.json").write_text(json.dumps({**skipped, "reason": "other"}))
    proc = make_venv(*args, *route)
    assert proc.returncode == 1 and "te-build.json is different" in proc.stderr, proc.stderr

    proc = make_venv(*args, "--te-record", copied)
    assert proc.returncode == 2 and "--te-record needs --te-wheel-dir" in proc.stderr


def test_registry_matches_pyproject() -> None:
    registry = ep_backends.load_registry()
    assert list(registry) == list(ep_backends.BACKEND_NAMES)
    assert registry["deepep_v2"].distribution == "sgl-deep-ep"
    assert registry["hybridep"].git == "https://github.com/deepseek-ai/DeepEP"
    assert registry["hybridep"].git_rev and len(registry["hybridep"].git_rev) == 40
    with pytest.raises(ep_backends.UnknownBackendError, match="deepep_v1, deepep_v2, hybridep"):
        ep_backends.validate_backend("deepep")
    assert ep_backends.expand_backends(["all"]) == list(ep_backends.BACKEND_NAMES)
    assert ep_backends.expand_backends(["hybridep,deepep_v1"]) == ["deepep_v1", "hybridep"]


def test_hybridep_without_github_fails_cleanly(tmp_path: Path) -> None:
    prefix = tmp_path / "venvs"
    (prefix / ".hybridep.tmp-stale").mkdir(parents=True)  # as an interrupted build leaves it
    gitconfig = tmp_path / "gitconfig"
    gitconfig.write_text(
        '[url "file:///nonexistent/github-mirror/"]\n\tinsteadOf = https://github.com/\n'
    )
    if missing_rdma_headers():
        pytest.skip(
            "rdma-core headers missing (python3 scripts/bootstrap.py --tests installs them)"
        )
    env = {
        **os.environ,
        "GIT_CONFIG_GLOBAL": str(gitconfig),
        "GIT_CONFIG_NOSYSTEM": "1",
        "UV_CACHE_DIR": str(tmp_path / "uv-cache"),
        # A toolkit that passes the build's preflight, so the clone is what fails.
        "CUDA_HOME": str(fake_cuda(tmp_path / "cuda")),
    }
    # The fetch fails at once, and uv stops the registry downloads it had started with it.
    proc = make_venv("--backend", "hybridep", "--prefix", prefix, env=env)

    assert proc.returncode == 1, proc.stdout + proc.stderr
    message = proc.stderr
    assert "could not clone the git source of deep-ep" in message
    assert "github.com" in message and "insteadOf" in message and "network" in message
    assert "Traceback" not in message
    assert not (prefix / "hybridep").exists()
    assert leftovers(prefix) == [], "no temporary venv left behind"


def missing_rdma_headers() -> list[str]:
    return [h for h in toolchain.RDMA_HEADERS if not (Path("/usr/include") / h).is_file()]


def test_hybridep_preflight_names_the_missing_toolkit_before_any_download(tmp_path: Path) -> None:
    """HybridEP's multi-node build needs nvcc, rdma-core's headers and the NVML stub: without a
    toolkit make_venv stops before uv downloads anything, says what to install, leaves nothing."""
    prefix = tmp_path / "venvs"
    env = {**os.environ, "UV_CACHE_DIR": str(tmp_path / "uv-cache"), "CUDA_HOME": str(tmp_path)}
    proc = make_venv("--backend", "hybridep", "--prefix", prefix, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "hybridep cannot be built here" in proc.stderr
    assert f"no nvcc at {tmp_path}/bin/nvcc" in proc.stderr and "CUDA_HOME" in proc.stderr
    assert "libnvidia-ml.so.1" in proc.stderr and "Traceback" not in proc.stderr
    if missing_rdma_headers():
        assert "apt-get install libibverbs-dev" in proc.stderr
    assert not (tmp_path / "uv-cache").exists() or not any((tmp_path / "uv-cache").rglob("*.whl"))
    assert leftovers(prefix) == [] and not (prefix / "hybridep").exists()


@pytest.mark.skipif(
    shutil.which("cc") is None,
    reason="the stand-in HybridEP needs a C compiler (python3 scripts/bootstrap.py --tests)",
)
def test_hybridep_from_a_git_mirror_builds_against_the_venvs_nvshmem(tmp_path: Path) -> None:
    """Host mode's HybridEP build: the git source through url.<mirror>.insteadOf, and
    make_venv's NVSHMEM set-up (the image's ep-hybridep stage runs the same, see
    test_image_build.py::test_git_source_builds_through_the_gitconfig_secret)."""
    version = pins.locked_versions(ROOT, nvshmem.DISTRIBUTION).pop()
    fake = fake_hybridep.make(tmp_path / "mirror", version, dict(os.environ))
    config = fake_hybridep.gitconfig(tmp_path / "gitconfig", f"file://{fake.bare}")
    env = {**os.environ, "GIT_CONFIG_GLOBAL": str(config), "GIT_CONFIG_NOSYSTEM": "1"}
    env["CUDA_HOME"] = str(fake_cuda(tmp_path / "cuda"))  # nvcc and the driver stubs
    # Its own cache: the build key holds CUDA_HOME (new per run), and dropping the cached build
    # needs the cache to itself, which the `uv run` running pytest holds.
    env["UV_CACHE_DIR"] = str(tmp_path / "uv-cache")
    prefix = tmp_path / "venvs"
    args = ("--backend", "hybridep", "--prefix", prefix, "--project", fake.project)
    proc = make_venv(*args, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    venv = prefix / "hybridep"
    sp = site_packages(venv)
    built_with = json.loads((sp / "deep_ep" / "_build_env.json").read_text())
    fake_hybridep.assert_built_by_make_venv(built_with, str(prefix))
    info = json.loads((venv / "ep-backend.json").read_text())
    assert info["backend_installed"] is True
    assert info["nvshmem_build"]["extension"]["runpath"] == [nvshmem.RUNPATH]
    # The venv was renamed into place: the real loader finds NVSHMEM through $ORIGIN.
    extension = next(sp.glob("deep_ep_cpp*.so"))
    ldd = subprocess.run(["ldd", str(extension)], capture_output=True, text=True).stdout
    assert f"=> {sp}/nvidia/nvshmem/lib/libnvshmem_host.so.3" in ldd, ldd
    assert leftovers(prefix) == []


def test_host_mode_and_the_image_build_hybridep_with_the_same_code() -> None:
    """One code path: build_host.sh (ep_image/build_steps/build_host.py) and the image's
    ep-<backend> stages both run make_venv.py (the image with --complete, whose sync is host mode's:
    test_skeleton_then_complete_...), and the NVSHMEM set-up lives only in
    ep_image/build_steps/_source_builds/nvshmem.py, which make_venv's backend sync calls."""
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    stage = dockerfile.split("AS ep-hybridep\n", 1)[1].split("\nFROM ", 1)[0]
    stage = " ".join(stage.replace("\\\n", " ").split())  # one line per instruction
    assert "python3 -m ep_image.build_steps.make_venv --complete --backend hybridep" in stage
    assert "-m ep_image.build_steps.build_host" in (SCRIPTS / "build_host.sh").read_text()
    host = ROOT / "ep_image" / "build_steps" / "build_host.py"
    assert '"ep_image.build_steps.make_venv"' in host.read_text()
    build = ROOT / "ep_image" / "build_steps"
    assert "nvshmem.build_environment(" in (build / "make_venv" / "backend_sync.py").read_text()
    assert "sync_backend(" in (build / "make_venv" / "cli.py").read_text()
    for path in [*(ROOT / "docker").iterdir(), SCRIPTS / "build_host.sh", host]:
        if path.is_file():
            assert "NVSHMEM_DIR" not in path.read_text(), f"{path} has its own NVSHMEM set-up"


@pytest.mark.slow
def test_deepep_v2_venv_from_the_lock(tmp_path: Path) -> None:
    prefix = tmp_path / "venvs"
    te_wheel = build_wheel(
        tmp_path / "wheels",
        "transformer_engine",
        "2.17.0",
        {"transformer_engine/__init__.py": "__version__ = '2.17.0'  # stand-in for build_te.py\n"},
    )
    proc = make_venv(
        "--backend", "deepep_v2", "--prefix", prefix, "--te-wheel", te_wheel, "--dedup"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    venv = prefix / "deepep_v2"
    # --dedup (the image's ep stages): nothing identical is left unlinked inside the venv.
    dry_run = [sys.executable, "-m", "ep_image.build_steps.dedup", "--dry-run", "--json"]
    again = subprocess.run([*dry_run, str(tmp_path / "d.json"), str(venv)],
                           capture_output=True, text=True, check=True, timeout=600)  # fmt: skip
    left = json.loads((tmp_path / "d.json").read_text())
    assert left["du_bytes_before"] == left["du_bytes_after"], again.stderr
    assert "sgl-deep-ep 0.1.2.post1" in proc.stdout

    info = json.loads((venv / "ep-backend.json").read_text())
    assert (info["backend"], info["extra"], info["distribution"]) == (
        "deepep_v2",
        "deepep_v2",
        "sgl-deep-ep",
    )
    assert info["lock_sha256"] == hashlib.sha256((ROOT / "uv.lock").read_bytes()).hexdigest()
    assert info["backend_installed"] is True
    assert info["dedup"]["du_bytes_after"] <= info["dedup"]["du_bytes_before"]
    installed = {d["name"]: d["version"] for d in info["installed"]}
    assert installed["sgl-deep-ep"] == "0.1.2.post1"
    assert installed["torch"] == "2.14.1"
    assert installed["transformer-engine"] == "2.17.0"
    assert info["te_wheels"][0]["sha256"] == hashlib.sha256(te_wheel.read_bytes()).hexdigest()
    for other in ("tokenspeed-deepep", "deep-ep"):
        assert other not in installed

    sp = site_packages(venv)
    assert (sp / "deep_ep" / "buffers" / "elastic.py").is_file()
    assert (sp / "deep_ep" / "buffers" / "legacy.py").is_file()
    assert not (sp / "deep_ep" / "buffer.py").exists(), "no v1 layout"
    assert not (sp / "deep_ep" / "hybrid_ep_buffer.py").exists(), "no HybridEP layout"
    dists = {p.name.split("-")[0] for p in sp.glob("*.dist-info")}
    assert "sgl_deep_ep" in dists and not dists & {"tokenspeed_deepep", "deep_ep"}

    # Built under a temporary name, then renamed: nothing may point at that name.
    assert leftovers(prefix) == []
    prefix_seen = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sys; print(sys.prefix)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert prefix_seen == str(venv)
    for script in (venv / "bin").iterdir():
        if script.is_file() and not script.is_symlink():
            assert b".deepep_v2.tmp-" not in script.read_bytes(), script

    # A rebuild replaces the venv only once the new one is complete.
    first_inode = (venv / "ep-backend.json").stat().st_ino
    proc = make_venv("--backend", "deepep_v2", "--prefix", prefix)
    assert proc.returncode == 0, proc.stderr
    assert (venv / "ep-backend.json").stat().st_ino != first_inode
    assert "transformer-engine" not in {
        d["name"] for d in json.loads((venv / "ep-backend.json").read_text())["installed"]
    }
    assert leftovers(prefix) == []


def test_a_prefix_with_a_space_a_colon_and_a_newline_builds(tmp_path: Path) -> None:
    """Any directory name a file system allows: before, the ABI check joined the libraries into
    LD_PRELOAD with spaces (which the loader also splits at colons) and refused a venv that
    imports torch fine ("libc10.so is not found by the dynamic loader"). The record names the
    venv's extensions relative to the venv, not by the temporary name it was built under."""
    prefix = tmp_path / "pre fix:with\nnewline"
    proc = make_venv("--backend", "deepep_v2", "--prefix", prefix)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    venv = prefix / "deepep_v2"
    info = json.loads((venv / "ep-backend.json").read_text())
    assert info["abi"] and all(entry["ok"] for entry in info["abi"]), info["abi"]
    for entry in info["abi"]:
        assert not os.path.isabs(entry["extension"]), entry["extension"]
        assert ".tmp-" not in json.dumps(entry), entry
        assert (venv / entry["extension"]).is_file(), entry["extension"]
    imported = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import torch; print(torch.__version__)"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert imported.returncode == 0, imported.stderr
    assert leftovers(prefix) == []


@pytest.mark.skipif(
    shutil.which("cc") is None,
    reason="the stand-in DeepEP needs a C compiler (python3 scripts/bootstrap.py --tests)",
)
def test_build_host_builds_two_backends_and_dedups(tmp_path: Path) -> None:
    """Host mode: DeepEP v1 and HybridEP from their git commits (stand-ins of both layouts,
    through a mirror), each built by make_venv against its venv's NVSHMEM, then deduplicated."""
    if missing_rdma_headers():
        pytest.skip(
            "rdma-core headers missing (python3 scripts/bootstrap.py --tests installs them)"
        )
    version = pins.locked_versions(ROOT, nvshmem.DISTRIBUTION).pop()
    fake = fake_hybridep.make(tmp_path / "mirror", version, dict(os.environ),
                              layouts=("deepep_v1", "hybridep"))  # fmt: skip
    config = fake_hybridep.gitconfig(tmp_path / "gitconfig", f"file://{fake.bare}")
    prefix = tmp_path / "host"
    env = {**os.environ, "PYTHON": sys.executable, "UV_COMPILE_BYTECODE": "1",
           "GIT_CONFIG_GLOBAL": str(config), "GIT_CONFIG_NOSYSTEM": "1",
           "CUDA_HOME": str(fake_cuda(tmp_path / "cuda")),
           "UV_CACHE_DIR": str(tmp_path / "uv-cache")}  # fmt: skip
    proc = subprocess.run(
        [str(SCRIPTS / "build_host.sh"), "--prefix", str(prefix), "--project", str(fake.project),
         "--backends", "deepep_v1,hybridep", "--activate", "deepep_v1"],
        capture_output=True, text=True, timeout=1800, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for backend in ("deepep_v1", "hybridep"):
        info = json.loads((prefix / backend / "ep-backend.json").read_text())
        assert info["backend"] == backend and info["backend_installed"]
        assert info["source"] == f"{fake_hybridep.UPSTREAM}@{fake.commits[backend]}"
        assert info["nvshmem_build"]["extension"]["runpath"] == [nvshmem.RUNPATH]
    v1 = site_packages(prefix / "deepep_v1") / "deep_ep"
    assert (v1 / "buffer.py").is_file() and not (v1 / "hybrid_ep_buffer.py").exists()
    assert (site_packages(prefix / "hybridep") / "deep_ep" / "hybrid_ep_buffer.py").is_file()
    assert os.readlink(prefix / "active") == "deepep_v1"
    report = json.loads((prefix / "dedup.json").read_text())
    assert report["bytes_after"] < report["bytes_before"], "the shared NVSHMEM is linked"
    # One build key per extra: the two commits of deep-ep do not drop each other's builds.
    keys = sorted(p.name for p in (tmp_path / "uv-cache").glob(".ep-build-key-*"))
    assert keys == [".ep-build-key-deep-ep-deepep_v1.json", ".ep-build-key-deep-ep-hybridep.json"]
    assert "its cached builds dropped" not in proc.stdout


def host_env(**extra: str) -> dict[str, str]:
    """This environment for host mode: this Python, no EP_PREFIX/EP_BACKENDS unless given."""
    env = {k: v for k, v in os.environ.items() if k not in ("EP_PREFIX", "EP_BACKENDS")}
    return {**env, "PYTHON": sys.executable, **extra}


def build_host(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPTS / "build_host.sh"), *map(str, args)], capture_output=True,
                          text=True, env=env or host_env(), timeout=300)  # fmt: skip


def test_build_host_usage_errors_exit_2_in_one_line(tmp_path: Path) -> None:
    """Each usage error of build_host.sh (ep_image/build_steps/build_host.py behind it) is one line
    naming the argument, exit 2, before anything is made."""
    prefix = tmp_path / "venvs"
    cases = [
        ((), "build_host.sh: usage error: --prefix DIR (or EP_PREFIX) is required"),
        (("--prefix",), "build_host.sh: usage error: --prefix needs DIR"),
        (("--prefix", prefix, "--backends"), "build_host.sh: usage error: --backends needs LIST"),
        (("--prefix", prefix, "--te-wheel"), "build_host.sh: usage error: --te-wheel needs PATH"),
        (
            ("--prefix", prefix, "--activate"),
            "build_host.sh: usage error: --activate needs BACKEND",
        ),
        (("--prefix", prefix, "--bogus"), "build_host.sh: usage error: unknown argument --bogus"),
        (("--prefix", prefix, "stray"), "build_host.sh: usage error: unknown argument stray"),
        (
            ("--pre", prefix),
            "build_host.sh: usage error: unknown argument --pre",
        ),  # no abbreviations
    ]
    for args, says in cases:
        proc = build_host(*args)
        assert proc.returncode == 2, (args, proc.stdout + proc.stderr)
        assert proc.stderr.splitlines()[0] == says, (args, proc.stderr)
        assert "Traceback" not in proc.stderr and proc.stdout == ""
        if "unknown" in says:  # the usage follows, as the shell script printed it
            assert "usage: build_host.sh --prefix DIR" in proc.stderr
    assert not prefix.exists()


def test_build_host_help_and_the_module_behind_it(tmp_path: Path) -> None:
    """--help documents every flag and the exit codes; `python -m ep_image.build_steps.build_host`
    (the build-host entry point) is the same command, with EP_PREFIX and EP_BACKENDS as defaults,
    and names itself by the file it runs as (build_host.py), as build_host.sh does by its own."""
    proc = build_host("--help")
    assert proc.returncode == 0, proc.stderr
    flags = ["--prefix DIR", "--backends LIST", "--te-wheel PATH", "--python PY", "--project DIR"]
    for text in (*flags, "--no-read-only", "--activate BACKEND", "Exit codes: 0"):
        assert text in proc.stdout, text
    host = [sys.executable, "-m", "ep_image.build_steps.build_host"]
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    proc = subprocess.run(host, capture_output=True, text=True,
                          env=host_env(EP_PREFIX=str(a_file)))  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"build_host.py: error: cannot create --prefix {a_file}" in proc.stderr
    # An unknown backend is make_venv's usage error (exit 2): passed on, after the summary.
    prefix = tmp_path / "venvs"
    proc = subprocess.run(host, capture_output=True, text=True,
                          env=host_env(EP_PREFIX=str(prefix), EP_BACKENDS="deepep_v3"))  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "unknown EP backend 'deepep_v3'" in proc.stderr and "Traceback" not in proc.stderr
    assert f"build_host.py: backends under {prefix}: \n" in proc.stdout
    assert f"EP_PREFIX={prefix} {SCRIPTS / 'use-ep'} BACKEND" in proc.stdout
    assert list(prefix.iterdir()) == []


def test_build_host_without_a_python_to_run_it_says_how_to_get_one(tmp_path: Path) -> None:
    """A PATH with neither python3 nor uv (and no $PYTHON): exit 1 naming the bootstrap."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "dirname").symlink_to(shutil.which("dirname") or "/usr/bin/dirname")
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path)}
    proc = subprocess.run(["/bin/sh", str(SCRIPTS / "build_host.sh"), "--help"],
                          capture_output=True, text=True, env=env, timeout=60)  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "needs Python >= 3.11" in proc.stderr
    assert "python3 scripts/bootstrap.py" in proc.stderr


def test_complete_needs_a_skeleton_of_this_lock_and_skip_list(tmp_path: Path) -> None:
    """--complete (the image's ep stages) refuses before syncing anything."""
    prefix = tmp_path / "venvs"
    proc = make_venv("--complete", "--backend", "deepep_v2", "--prefix", prefix)
    assert proc.returncode == 1
    assert "ep-skeleton.json" in proc.stderr and "--skeleton" in proc.stderr
    (prefix / "deepep_v2").mkdir(parents=True)
    record = {
        "lock_sha256": hashlib.sha256((ROOT / "uv.lock").read_bytes()).hexdigest(),
        "skipped_packages": ["transformer-engine", "triton", "sgl-deep-ep"],
    }
    (prefix / "deepep_v2" / "ep-skeleton.json").write_text(json.dumps(record))
    proc = make_venv("--complete", "--backend", "deepep_v2", "--prefix", prefix)
    assert proc.returncode == 1
    assert "made from another skipped_packages" in proc.stderr, proc.stderr
    assert not (prefix / "deepep_v2" / "ep-backend.json").exists()


@pytest.mark.slow
def test_skeleton_then_complete_is_the_venv_a_direct_build_makes(tmp_path: Path) -> None:
    """The image's two steps (venvs-common, then ep-<backend>) give, file for file, the venv
    host mode builds in one; completing touches no file of the skeleton it starts from."""
    from _venv_helpers import snapshot

    skip = "nvidia-cublas nvidia-cufft nvidia-cusolver nvidia-nccl-cu13 triton"  # smaller venvs
    env = {**os.environ, "UV_COMPILE_BYTECODE": "1"}
    common = tmp_path / "common"
    both = ["--backend", "deepep_v1", "--backend", "deepep_v2"]
    proc = make_venv("--skeleton", *both, "--prefix", common, "--dedup",
                     "--no-install-packages", skip, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads((common / "venvs-common.json").read_text())
    assert record["skeletons"] == ["deepep_v1", "deepep_v2"] and record["dedup"] is not None
    for name, dist in (("deepep_v1", "deep-ep"), ("deepep_v2", "sgl-deep-ep")):
        skeleton = json.loads((common / name / "ep-skeleton.json").read_text())
        assert skeleton["backend_installed"] is False and dist in skeleton["skipped_packages"]
        assert not (common / name / "ep-backend.json").exists()
        assert not (site_packages(common / name) / "deep_ep").exists()
    torch_init = site_packages(common / "deepep_v2") / "torch" / "__init__.py"
    other = site_packages(common / "deepep_v1") / "torch" / "__init__.py"
    assert torch_init.stat().st_ino == other.stat().st_ino, "skeletons not deduplicated"
    before = torch_init.stat()

    proc = make_venv("--complete", "--backend", "deepep_v2", "--prefix", common,
                     "--no-install-packages", skip, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    venv = common / "deepep_v2"
    assert not (venv / "ep-skeleton.json").exists()
    info = json.loads((venv / "ep-backend.json").read_text())
    assert info["backend_installed"] is True and info["completed_from_skeleton"]
    after = torch_init.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    pyc = next((site_packages(venv) / "deep_ep" / "__pycache__").glob("__init__.*.pyc"))
    assert int.from_bytes(pyc.read_bytes()[4:8], "little") == 3, "new sources: checked-hash"

    direct = tmp_path / "direct"
    proc = make_venv("--backend", "deepep_v2", "--prefix", direct, "--no-install-packages", skip,
                     env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    completed, built = snapshot(venv), snapshot(direct / "deepep_v2")
    for tree in (completed, built):
        tree.pop("ep-backend.json")
    assert completed == built
