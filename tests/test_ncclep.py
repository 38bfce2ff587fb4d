"""NCCL EP (``ncclep``, the real nccl-extensions wheel) on a machine without a GPU: what CI proves.

make_venv builds its venv from the lock; in it check-ep stops at the import step with exit 5
naming the driver that ``libnccl_ep.so`` needs, check-env reports the library and the NCCL it
binds to, the adapter names what its JIT needs before any buffer is made, check-installed finds
nothing wrong; and the ABI check binds ``libnccl_ep.so`` to the venv's ``libnccl.so.2``, failing
on a real older NCCL that lacks symbols it needs (a lock that moves NCCL under it). What only a
GPU shows is docs/backends.md's "NCCL EP" section.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from _venv_helpers import ROOT, install, make_uv_venv, site_packages

from ep_image import backends as ep_backends
from ep_image.build_steps import check_installed
from ep_image.build_steps._uv.run import BuildError
from ep_image.build_steps.make_venv.venv_checks import check_abi
from ep_image.native import abi, loader

BACKEND = "ncclep"
SPEC = ep_backends.spec(BACKEND)
LIBRARY = "nccl/ep/lib/cu13/libnccl_ep.so"
#: NCCL symbols libnccl_ep.so (nccl-extensions 0.1.0) needs that NCCL 2.28.9 does not export
#: (`nm -D` of both).
NEWER_THAN_2_28 = {"ncclCommQueryProperties", "ncclGetPeerDevicePointer", "ncclWinGetUserPtr"}

pytestmark = pytest.mark.slow


def locked_version(name: str) -> str:
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    return next(p["version"] for p in lock["package"] if p["name"] == name)


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The backend's venv as host mode and the image build it: make_venv, from the lock."""
    prefix = tmp_path_factory.mktemp("ncclep") / "venvs"
    cmd = [sys.executable, "-m", "ep_image.build_steps.make_venv", "--backend", BACKEND]
    proc = subprocess.run(
        [*cmd, "--prefix", str(prefix), "--python", sys.executable],
        capture_output=True, text=True, timeout=1800, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"ABI ok: .*libnccl_ep\.so binds", proc.stdout), proc.stdout
    return prefix / BACKEND


def run(venv: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(venv / "bin" / args[0]), *args[1:]],
        capture_output=True, text=True, timeout=600, check=False, env={**os.environ, **env},
    )  # fmt: skip


def test_the_venv_builds_from_the_lock(venv: Path) -> None:
    record = json.loads((venv / "ep-backend.json").read_text())
    assert (record["backend"], record["module"]) == (BACKEND, "nccl.ep")
    installed = {d["name"]: d["version"] for d in record["installed"]}
    assert installed[SPEC.distribution] == locked_version(SPEC.distribution)
    # Its NCCL is the lock's, the one torch pins as well: one libnccl for both.
    assert installed["nvidia-nccl-cu13"] == locked_version("nvidia-nccl-cu13")
    assert installed["torch"] == locked_version("torch")
    # The check ran in the venv's temporary directory, before the rename: match by the tail.
    checked = [r for r in record["abi"] if r["extension"].endswith("/site-packages/" + LIBRARY)]
    assert len(checked) == 1 and checked[0]["ok"] and checked[0]["complete"], record["abi"]
    report = check_installed.check(venv, BACKEND)
    assert report.problems == [], report.problems
    assert LIBRARY in report.extensions
    assert report.extensions[LIBRARY]["libnccl.so.2"].endswith("nvidia/nccl/lib/libnccl.so.2")


def test_check_ep_without_a_driver_exits_5_naming_it(venv: Path, tmp_path: Path) -> None:
    """Its module imports on CPU; its library does not load without libcuda.so.1, and the
    adapter's load says so: cannot run here (5), not a broken backend (3)."""
    report_path = tmp_path / "check_ep.json"
    proc = run(venv, "check-ep", "--backend", BACKEND, "--json", str(report_path))
    assert proc.returncode == 5, proc.stdout + proc.stderr
    report = json.loads(report_path.read_text())
    steps = {s["name"]: s for s in report["steps"]}
    imported = steps["import"]
    assert imported["status"] == "skip", imported
    assert "libnccl_ep.so needs the GPU driver's libcuda.so.1" in imported["detail"]
    assert "NVIDIA driver" in imported["hint"] and "--backend torch" in imported["hint"]
    assert "libcuda.so.1" in imported["data"]["load_error"]
    assert steps["prerequisites"]["status"] == "not run"
    # The facts come before the load: the library, its release, the NCCL loaded and its mode.
    data = imported["data"]
    assert data["library"] == str(site_packages(venv) / LIBRARY)
    assert data["nccl_loaded"] == locked_version("nvidia-nccl-cu13")
    assert "low-latency" in data["not_checked"] and "flat layout" in data["mode"]
    assert data["commit_source"].startswith("unknown: NVIDIA's PyPI wheel")
    # auto finds it too: the only backend in this venv.
    auto = run(venv, "check-ep", "--json", str(tmp_path / "auto.json"))
    assert auto.returncode == 5 and f"backend {BACKEND} (auto:" in auto.stdout, auto.stdout


def test_check_env_reports_the_library_and_the_nccl_it_binds_to(venv: Path, tmp_path: Path) -> None:
    proc = run(venv, "check-env", "--json", str(tmp_path / "env.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    backend = json.loads((tmp_path / "env.json").read_text())["ep_backend"]
    assert (backend["detected"], backend["module"]) == (BACKEND, "nccl.ep")
    site = site_packages(venv)
    library = backend["library"]
    assert library["library"] == str(site / LIBRARY)
    header = (site / "nccl" / "ep" / "include" / "nccl_ep.h").read_text()
    parts = dict(re.findall(r"#define NCCL_EP_(MAJOR|MINOR|PATCH) (\d+)", header))
    assert library["library_release"] == f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}"
    assert library["nccl_bound"] == os.path.realpath(site / "nvidia/nccl/lib/libnccl.so.2")
    assert library["nccl_bound_release"] == locked_version("nvidia-nccl-cu13")
    assert "ep library" in proc.stdout and "binds NCCL" in proc.stdout


# The adapter as the worker drives it: load (which on CPU ends at the driver, after importing
# nccl.ep, which sets NCCL_EP_HOME and NCCL_HOME where unset), then its prerequisites.
PREREQUISITES = """
import json, sys
from ep_image.probes._report import StepFailed
from ep_image.files import trust
from ep_image.probes._adapters import plugins
backend = plugins.BUILTIN[sys.argv[1]]()
try:
    backend.load()
except StepFailed as stop:
    assert "libcuda.so.1" in stop.detail, stop.detail
data, problems = backend.prerequisites()
cache = backend.jit_cache_dir()
print(json.dumps({"data": data, "problems": [[p[0].value, p[1], p[2]] for p in problems],
                  "cache": str(cache), "cache_untrusted": trust.untrusted_cache(cache)}))
"""


#: What NCCL EP's JIT reads from the environment: unset for the test, then set by each case.
JIT_VARIABLES = (
    "NCCL_EP_JIT_NVCC", "NVCC", "CUDA_HOME", "CUDA_PATH", "NCCL_EP_HOME", "NCCL_HOME",
    "NCCL_EP_JIT_SOURCE_DIR", "NCCL_EP_JIT_BUILD_INCLUDE_DIR", "NCCL_EP_JIT_CUDA_INCLUDE_DIR",
)  # fmt: skip


def prerequisites(venv: Path, **env: str) -> dict:
    unset = (*JIT_VARIABLES, "NCCL_EP_JIT_CACHE_DIR", "XDG_CACHE_HOME")
    base = {k: v for k, v in os.environ.items() if k not in unset}
    proc = subprocess.run(
        [str(venv / "bin" / "python"), "-c", PREREQUISITES, BACKEND],
        capture_output=True, text=True, timeout=600, check=False, env={**base, **env},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def fake_nvcc(path: Path, release: str) -> str:
    """An nvcc that prints what a CUDA ``release`` nvcc prints for --version."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "#!/bin/sh\necho 'Cuda compilation tools, release "
        f"{release.rsplit('.', 1)[0]}, V{release}'\n"
    )
    path.chmod(0o755)
    return str(path)


def test_prerequisites_name_what_the_jit_needs(venv: Path, tmp_path: Path) -> None:
    """Before any buffer: the nvcc its JIT runs (of the CUDA major its library was chosen for),
    its own headers, and NCCL's headers of the release loaded. Checked on CPU: the loaded NCCL
    is nccl4py's ncclGetVersion, which needs no driver."""
    nvcc13 = fake_nvcc(tmp_path / "cuda13" / "nvcc", "13.0.88")
    good = prerequisites(venv, NCCL_EP_JIT_NVCC=nvcc13)
    assert good["problems"] == [], good["problems"]
    jit = good["data"]["jit"]
    site = site_packages(venv)
    assert jit["source_dir"] == str(site / "nccl/ep/include/nccl_ep")
    assert jit["nccl_include_dir"] == str(site / "nvidia/nccl/include")
    assert good["data"]["jit_nccl_headers_release"] == good["data"]["nccl_loaded"]
    # The JIT's own headers are read where it reads them (include/nccl_ep.h beside nccl_ep/)
    # and match the release the package was built as (no driver here to load the library).
    header = (site / "nccl" / "ep" / "include" / "nccl_ep.h").read_text()
    parts = dict(re.findall(r"#define NCCL_EP_(MAJOR|MINOR|PATCH) (\d+)", header))
    assert good["data"]["jit_source_release"] == ".".join(
        parts[k] for k in ("MAJOR", "MINOR", "PATCH")
    )
    # With nothing set, the venv (the project's .pth) points the JIT's kernel cache at this
    # user's own directory, which the probe trusts; the library's /tmp default it refuses.
    home = Path(pwd.getpwuid(os.getuid()).pw_dir)
    assert good["cache"] == str(home / ".cache" / "nccl_ep" / "jit"), good["cache"]
    assert good["cache_untrusted"] is None
    shared = prerequisites(venv, NCCL_EP_JIT_NVCC=nvcc13, NCCL_EP_JIT_CACHE_DIR="/tmp/nccl_ep/jit")
    assert shared["cache"] == "/tmp/nccl_ep/jit" and "others can write" in shared["cache_untrusted"]

    # JIT headers of another release than the package's: named before any kernel compiles.
    other = tmp_path / "ep-0.1.9" / "include"
    (other / "nccl_ep" / "device").mkdir(parents=True)
    (other / "nccl_ep.h").write_text(
        "#define NCCL_EP_MAJOR 0\n#define NCCL_EP_MINOR 1\n#define NCCL_EP_PATCH 9\n"
    )
    mixed = prerequisites(venv, NCCL_EP_JIT_NVCC=nvcc13, NCCL_EP_HOME=str(other.parent))
    assert [p[1] for p in mixed["problems"]] == [
        f"NCCL EP's JIT headers at {other}/nccl_ep are release 0.1.9, the library installed is "
        f"{good['data']['jit_source_release']}"
    ], mixed["problems"]

    old = tmp_path / "nccl-2.28" / "include"
    (old / "nccl_device").mkdir(parents=True)
    (old / "nccl.h").write_text(
        "#define NCCL_MAJOR 2\n#define NCCL_MINOR 28\n#define NCCL_PATCH 9\n"
    )
    nvcc12 = fake_nvcc(tmp_path / "cuda12" / "nvcc", "12.9.86")
    bad = prerequisites(
        venv, NCCL_EP_JIT_NVCC=nvcc12, NCCL_HOME=str(old.parent), NCCL_EP_HOME=str(tmp_path)
    )
    details = [p[1] for p in bad["problems"]]
    assert any(f"would run {nvcc12} (V12.9.86), not a CUDA 13 nvcc" in d for d in details), details
    assert any("NCCL 2.28.9 headers" in d and "NCCL 2.30.7 is loaded" in d for d in details)
    assert any(f"JIT headers are not at {tmp_path}/include/nccl_ep" in d for d in details)
    assert all(p[0] == "error" and p[2] for p in bad["problems"]), bad["problems"]

    gone = prerequisites(venv, NCCL_EP_JIT_NVCC=str(tmp_path / "none" / "nvcc"))
    assert [p[1] for p in gone["problems"]] == [
        f"no nvcc for NCCL EP's JIT (resolved: {tmp_path}/none/nvcc)"
    ]


def test_the_abi_check_fails_when_the_nccl_under_it_lacks_its_symbols(tmp_path: Path) -> None:
    """The lock's torch and nccl-extensions (whose NCCL pins agree), then NCCL moved to the
    real 2.28.9 wheel, which lacks three symbols libnccl_ep.so needs: make_venv's check binds
    the library to the venv's libnccl.so.2 and refuses the venv, naming them."""
    torch, ncclep = (
        f"torch=={locked_version('torch')}",
        f"{SPEC.distribution}[cu13]=={locked_version(SPEC.distribution)}",
    )
    venv = make_uv_venv(
        tmp_path / "v", torch, ncclep, python=sys.executable, UV_LINK_MODE="hardlink"
    )
    site = site_packages(venv)
    library = site / LIBRARY
    bound, _ = loader.resolve(library, loader.torch_first(site))
    assert os.path.realpath(bound["libnccl.so.2"]) == str(site / "nvidia/nccl/lib/libnccl.so.2")
    assert check_abi(venv, [SPEC.distribution], strict=True)  # binds: the control

    install(venv, "--no-deps", "nvidia-nccl-cu13==2.28.9", UV_LINK_MODE="hardlink")
    results = {Path(r.extension).relative_to(site).as_posix(): r
               for r in abi.check(site, venv / "bin" / "python", [SPEC.distribution])}  # fmt: skip
    missing = {u.symbol for u in results[LIBRARY].failures if u.needed_by.endswith(LIBRARY)}
    assert missing == NEWER_THAN_2_28, results[LIBRARY].to_json()
    with pytest.raises(BuildError, match="the venv would not import") as refused:
        check_abi(venv, [SPEC.distribution], strict=True)
    assert "libnccl_ep.so" in str(refused.value) and "NCCL" in str(refused.value)
