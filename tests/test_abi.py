"""ep_image/native/abi.py: each symbol an extension needs binds to its venv's libraries, or it
fails.

The fast tests build real shared objects with gcc (a stand-in ``libc10.so`` exporting a torch
symbol under its mangled name, an extension needing another one, a libnccl without a symbol, a
driver stub) and ask the real loader. The slow ones use the real wheels: tokenspeed-deepep
1.2.1 (DeepEP v1, built against an older torch) on the lock's torch 2.14.1, through abi.check,
check_installed and make_venv; and sgl-deep-ep on the same torch as the control that binds.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _venv_helpers import build_wheel, make_uv_venv, site_packages, uv

from ep_image.build_steps import check_installed
from ep_image.native import abi

#: What tokenspeed-deepep 1.2.1's extension needs and torch 2.14.1's libc10 no longer exports.
COW = "_ZN3c104impl3cow23materialize_cow_storageERNS_11StorageImplE"
#: What torch 2.14.1 exports instead.
COW_NOW = "_ZN3c104impl3cow15materialize_cowEPNS_11StorageImplE"
TOKENSPEED = "tokenspeed-deepep==1.2.1.post20251110"

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build ELF files")


def shared(out: Path, source: str, *args: str, soname: str | None = None) -> Path:
    """Compile ``source`` (C) into the shared object ``out``."""
    src = out.with_suffix(".c")
    src.write_text(source + "\n")
    flags = [f"-Wl,-soname,{soname}"] if soname else []
    cmd = ["gcc", "-shared", "-fPIC", "-o", str(out), str(src), *flags, *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out


def alias(name: str, symbol: str) -> str:
    """A C declaration of ``name`` under the (mangled) linker name ``symbol``."""
    return f'int {name}(void) __asm__("{symbol}");'


@pytest.fixture
def libs(tmp_path: Path) -> Path:
    """A stand-in torch (libc10.so) and NCCL (libnccl.so.2) in one directory."""
    lib = tmp_path / "lib"
    lib.mkdir()
    shared(lib / "libc10.so", f"{alias('now', COW_NOW)} int now(void){{return 1;}}")
    shared(lib / "libnccl.so.2", "int ncclGetVersion(void){return 22809;}", soname="libnccl.so.2")
    return lib


def extension(tmp_path: Path, libs: Path, body: str, *links: str) -> Path:
    """An extension linking ``links`` (from ``libs``) whose code calls what ``body`` declares."""
    return shared(tmp_path / "ext.so", body, f"-L{libs}", *links, f"-Wl,-rpath,{libs}")


def python() -> Path:
    return Path(sys.executable)


@needs_gcc
def test_a_torch_symbol_the_venvs_torch_lacks_fails_and_names_it(
    tmp_path: Path, libs: Path
) -> None:
    ext = extension(tmp_path, libs, f"{alias('old', COW)} int f(void){{return old();}}", "-lc10")
    result = abi.bind(ext, python(), [str(libs / "libc10.so")], env={})
    assert not result.ok and result.complete
    assert [(u.symbol, u.origin) for u in result.failures] == [(COW, "torch")]
    problem = result.problems("2.14.1")[0]
    assert "built against another torch" in problem and "torch 2.14.1" in problem
    assert COW in problem and "Fix: build it from source" in problem


@needs_gcc
def test_symbols_that_bind_pass_python_ones_included(tmp_path: Path, libs: Path) -> None:
    """The venv's python is the program, as at import: an extension's Py* symbols bind to it."""
    body = f"{alias('now', COW_NOW)} long PyLong_AsLong(void*);"
    body += " int f(void){return now() + (int)PyLong_AsLong(0);}"
    ext = extension(tmp_path, libs, body, "-lc10")
    result = abi.bind(ext, python(), [str(libs / "libc10.so")], env={})
    assert result.ok and result.complete and result.unresolved == [], result


@needs_gcc
def test_another_librarys_missing_symbol_fails_only_when_every_library_was_found(
    tmp_path: Path, libs: Path
) -> None:
    """DeepEP v2 on an NCCL older than it was built for: found, but without the symbol."""
    body = "int ncclCommQueryProperties(void); int f(void){return ncclCommQueryProperties();}"
    ext = extension(tmp_path, libs, body, "-l:libnccl.so.2")
    result = abi.bind(ext, python(), [], env={})
    assert [(u.symbol, u.origin) for u in result.failures] == [("ncclCommQueryProperties", "other")]
    assert "built against other versions of its libraries" in result.problems(None)[0]

    shared(libs / "libgone.so", "int gone(void){return 0;}", soname="libgone.so")
    also = " int gone(void); int g(void){return gone();}"
    ext = extension(tmp_path, libs, body + also, "-l:libnccl.so.2", "-lgone")
    (libs / "libgone.so").unlink()  # a library left out of the venv may export it
    result = abi.bind(ext, python(), [], env={})
    assert result.not_found == ["libgone.so"] and not result.complete
    assert result.ok and result.failures == []
    assert result.problems(None, strict=False) == []
    assert "libgone.so is not found" in result.problems(None, strict=True)[0]


@needs_gcc
def test_driver_symbols_bind_to_the_toolkit_stub_or_are_left_unjudged(
    tmp_path: Path, libs: Path
) -> None:
    """No driver here: the CUDA toolkit's stub stands in for libcuda.so.1 where it exists."""
    shared(tmp_path / "libcuda.so.1", "int cuInit(unsigned f){return 0;}", soname="libcuda.so.1")
    body = "int cuInit(unsigned); int cuNewer(void); int f(void){return cuInit(0) + cuNewer();}"
    ext = shared(tmp_path / "ext.so", body, f"-L{tmp_path}", "-l:libcuda.so.1")
    (tmp_path / "libcuda.so.1").unlink()
    absent = abi.bind(ext, python(), [], env={"CUDA_HOME": str(tmp_path / "none")})
    assert absent.driver == "absent" and absent.ok and absent.complete
    assert {u.symbol for u in absent.unresolved} == {"cuInit", "cuNewer"}

    stubs = tmp_path / "cuda" / "lib64" / "stubs"
    stubs.mkdir(parents=True)
    shared(stubs / "libcuda.so", "int cuInit(unsigned f){return 0;}", soname="libcuda.so.1")
    stub = abi.bind(ext, python(), [], env={"CUDA_HOME": str(tmp_path / "cuda")})
    assert stub.driver == "stub" and stub.stand_ins == {"libcuda.so.1": str(stubs / "libcuda.so")}
    assert [u.symbol for u in stub.unresolved] == ["cuNewer"], "cuInit bound to the stub"
    assert stub.ok, "a symbol the stub lacks may be in the real driver: not a failure"


@pytest.mark.parametrize(
    ("symbol", "origin"),
    [
        (COW, "torch"),
        ("_ZNK2at10TensorBase4sizeEl", "torch"),
        ("_ZTVN5torch8autograd4NodeE", "torch"),
        ("_ZN6caffe28TypeMeta5_typeEv", "torch"),
        ("_ZN3c1010TensorImpl7releaseEv", "torch"),
        ("_ZNSt6vectorIN3c106SymIntESaIS1_EED2Ev", "other"),  # a std:: instantiation
        ("_ZN3fmt2v96detail5vformatEv", "other"),
        ("cuMemCreate", "driver"),
        ("nvmlInit_v2", "driver"),
        ("ncclCommQueryProperties", "other"),
        ("PyLong_AsLong", "other"),
    ],
)
def test_symbol_origin(symbol: str, origin: str) -> None:
    assert abi.symbol_origin(symbol) == origin


def test_check_ep_says_built_against_another_torch_not_reinstall() -> None:
    """The loader's message for the real failure (seen on the H200 with torch 2.14.1)."""
    from ep_image.probes import _backend_detect
    from ep_image.probes._report import Status

    output = (
        "ImportError: /venv/lib/python3.12/site-packages/deep_ep_cpp.cpython-312-x86_64-linux-"
        f"gnu.so: undefined symbol: {COW}"
    )
    status, detail, hint = _backend_detect.classify_import_failure("deepep_v1", output, 1, True)
    assert status == Status.ERROR and COW in detail
    assert "built against another torch" in hint and "cannot help" in hint


# --------------------------------------------------------------------------- the real wheels


@pytest.fixture(scope="module")
def tokenspeed_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """torch 2.14.1 (the lock's) with tokenspeed-deepep 1.2.1, as the lock held it until now."""
    venv = tmp_path_factory.mktemp("abi") / "venv"
    return make_uv_venv(venv, "torch==2.14.1", TOKENSPEED, python=sys.executable)


@pytest.mark.slow
def test_tokenspeed_deepep_1_2_1_on_torch_2_14_1_does_not_bind(tokenspeed_venv: Path) -> None:
    site = site_packages(tokenspeed_venv)
    results = abi.check(site, tokenspeed_venv / "bin" / "python", ["tokenspeed-deepep"])
    assert len(results) == 1 and Path(results[0].extension).name.startswith("deep_ep_cpp")
    assert [u.symbol for u in results[0].failures] == [COW]
    assert "built against another torch" in results[0].problems(abi.torch_version(site))[0]

    report = check_installed.check(tokenspeed_venv, "deepep_v1")
    assert any(COW in p and "another torch" in p for p in report.problems), report.problems
    assert report.distributions == {"tokenspeed-deepep": "1.2.1.post20251110"}


@pytest.mark.slow
def test_sgl_deep_ep_on_its_declared_torch_binds(tmp_path: Path) -> None:
    """The control: the wheel that declares torch==2.14.1 binds to it (driver aside)."""
    venv = make_uv_venv(tmp_path / "v2", "sgl-deep-ep==0.1.2.post1", python=sys.executable)
    site = site_packages(venv)
    results = abi.check(site, venv / "bin" / "python", ["sgl-deep-ep"])
    assert results and all(r.ok and r.complete for r in results), [r.to_json() for r in results]


def tokenspeed_as_deep_ep(tokenspeed_venv: Path, out: Path) -> Path:
    """tokenspeed-deepep 1.2.1's files, byte for byte, as a ``deep-ep`` wheel: the registry's
    deepep_v1 distribution carrying the broken build, for make_venv to refuse."""
    site = site_packages(tokenspeed_venv)
    files: dict[str, str | bytes] = {}
    for path in [*site.glob("deep_ep/*.py"), *site.glob("deep_ep_cpp*.so")]:
        files[str(path.relative_to(site))] = path.read_bytes()
    return build_wheel(out, "deep_ep", "1.2.1", files)


@pytest.mark.slow
def test_make_venv_refuses_a_venv_that_would_not_import(
    tokenspeed_venv: Path, tmp_path: Path
) -> None:
    """Host mode (one step) and the image's ep stage (--skeleton, then --complete) both fail
    naming the symbol and the fix, and leave no venv that anything would take for finished."""
    wheel = tokenspeed_as_deep_ep(tokenspeed_venv, tmp_path / "wheels")
    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text(
        "[project]\nname = 'abi-test'\nversion = '0'\nrequires-python = '>=3.11,<3.13'\n"
        "dependencies = []\n[project.optional-dependencies]\n"
        "deepep_v1 = ['torch==2.14.1', 'deep-ep==1.2.1']\n"
        "[tool.uv]\npackage = false\n"
        "environments = [\"sys_platform == 'linux' and platform_machine == 'x86_64'\"]\n"
        f"[tool.uv.sources]\ndeep-ep = {{ path = '{wheel}' }}\n"
    )
    uv("lock", "--project", str(project))
    prefix = tmp_path / "venvs"
    make_venv = [sys.executable, "-m", "ep_image.build_steps.make_venv", "--backend", "deepep_v1"]
    args = ["--prefix", str(prefix), "--project", str(project), "--python", sys.executable]

    proc = subprocess.run([*make_venv, *args], capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "would not import" in proc.stderr and "built against another torch" in proc.stderr
    assert COW in proc.stderr and "Traceback" not in proc.stderr
    assert not (prefix / "deepep_v1").exists() and not list(prefix.glob(".deepep_v1.*"))

    skeleton = subprocess.run([*make_venv, *args, "--skeleton"], capture_output=True, text=True)
    assert skeleton.returncode == 0, skeleton.stdout + skeleton.stderr
    complete = subprocess.run([*make_venv, *args, "--complete"], capture_output=True, text=True)
    assert complete.returncode == 1 and COW in complete.stderr, complete.stderr
    assert not (prefix / "deepep_v1" / "ep-backend.json").exists()
    assert (prefix / "deepep_v1" / "ep-skeleton.json").exists(), "still marked unfinished"


@needs_gcc
def test_driver_symbols_with_no_driver_library_linked_fail(tmp_path: Path) -> None:
    """A build linked against a libcuda stub that lacks the symbols it uses: with --as-needed the
    linker drops libcuda.so.1 and leaves cu* undefined, so the import fails on any node. Seen
    building DeepEP v1 against a hand-made stub; the real toolkit stub exports them all."""
    shared(tmp_path / "libcuda.so", "int cuInit(unsigned f){return 0;}", soname="libcuda.so.1")
    body = "int cuMemCreate(void); int f(void){return cuMemCreate();}"
    ext = shared(tmp_path / "ext.so", body, f"-L{tmp_path}", "-Wl,--as-needed", "-lcuda")
    needed = subprocess.run(["readelf", "-d", str(ext)], capture_output=True, text=True).stdout
    assert "libcuda.so.1" not in needed, "the linker kept libcuda: nothing to show"
    result = abi.bind(ext, python(), [], env={"CUDA_HOME": str(tmp_path / "none")})
    assert result.driver == "not linked"
    assert [u.symbol for u in result.failures] == ["cuMemCreate"] and not result.ok


def fake_distribution(site: Path, name: str, files: dict[str, Path]) -> None:
    """Install ``files`` (path in site-packages -> built object) as distribution ``name``."""
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    for rel, built in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(built, site / rel)
    (info / "RECORD").write_text("".join(f"{rel},,\n" for rel in files))


@needs_gcc
def test_a_packages_own_library_is_loaded_before_its_extension_module(tmp_path: Path) -> None:
    """Transformer Engine's case: ``transformer_engine_torch`` uses symbols of
    ``libtransformer_engine.so`` without naming it; the package dlopens that library first.
    A symbol that library lacks still fails."""
    build = tmp_path / "build"
    build.mkdir()
    core = shared(build / "libcore.so", "int core_fn(void){return 7;}")
    good = shared(build / "good.so", "int core_fn(void); int f(void){return core_fn();}")
    bad = shared(build / "bad.so", "int core_gone(void); int f(void){return core_gone();}")
    site = tmp_path / "site"
    module = "core_torch.cpython-312-x86_64-linux-gnu.so"
    fake_distribution(site, "coredist", {"coredist/libcore.so": core, f"coredist/{module}": good})
    results = {Path(r.extension).name: r for r in abi.check(site, python(), ["coredist"], env={})}
    assert set(results) == {"libcore.so", module}
    assert all(r.ok for r in results.values()), results
    # Alone (nothing loaded first), the module's symbol is unresolved: the preload is what binds.
    alone = abi.bind(site / "coredist" / module, python(), [], env={})
    assert [u.symbol for u in alone.unresolved] == ["core_fn"]
    broken = tmp_path / "broken"
    fake_distribution(broken, "coredist", {"coredist/libcore.so": core, f"coredist/{module}": bad})
    verdicts = {Path(r.extension).name: r.ok for r in abi.check(broken, python(), ["coredist"])}
    assert verdicts == {"libcore.so": True, module: False}


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("static", [True, False])
def test_an_extension_carrying_its_own_libstdcxx_fails_naming_the_compiler(
    tmp_path: Path, static: bool
) -> None:
    """HybridEP built by a compiler wrapper that adds -static-libstdc++ loaded, bound every
    symbol, and crashed in its buffer constructor: make_venv must refuse it before that."""
    src = tmp_path / "ext.cpp"
    body = 'extern "C" int f(const char* s){return std::string(s).size();}'
    src.write_text(f"#include <string>\n{body}\n")
    out = tmp_path / "ext.so"
    flags = ["-static-libstdc++"] if static else []
    subprocess.run(["g++", "-shared", "-fPIC", "-o", str(out), str(src), *flags], check=True)
    assert abi.carries_cxx_runtime(out) is static
    result = abi.bind(out, python(), [], env={})
    assert result.ok is not static
    if static:
        problems = result.problems(None)
        assert any("-static-libstdc++" in p and "CXX=/usr/bin/g++" in p for p in problems)


@needs_gcc
def test_paths_with_a_space_a_colon_and_a_newline_bind(tmp_path: Path) -> None:
    """Any directory name a file system allows: the loader's LD_PRELOAD splits at spaces and
    colons (no escape), so before, a venv under such a prefix was reported as not finding
    libc10.so while it imported torch fine."""
    odd = tmp_path / "pre fix:with\nnewline"
    lib = odd / "lib"
    lib.mkdir(parents=True)
    shared(lib / "libc10.so", f"{alias('now', COW_NOW)} int now(void){{return 1;}}")
    body = f"{alias('now', COW_NOW)} int f(void){{return now();}}"
    ext = shared(odd / "ext.so", body, f"-L{lib}", "-lc10", "-Wl,-rpath,$ORIGIN/lib")
    result = abi.bind(ext, python(), [str(lib / "libc10.so")], env={})
    assert result.ok and result.complete and result.unresolved == [], result
    assert result.extension == str(ext)
    closure = abi.loader.closure(ext)
    assert str(lib / "libc10.so") in closure, closure
    missing = abi.bind(
        shared(odd / "ext2.so", f"{alias('old', COW)} int g(void){{return old();}}",
               f"-L{lib}", "-lc10", "-Wl,-rpath,$ORIGIN/lib"),
        python(), [str(lib / "libc10.so")], env={},
    )  # fmt: skip
    assert [(u.symbol, u.needed_by) for u in missing.failures] == [(COW, str(odd / "ext2.so"))]
    # An extension module that names no torch library: torch's, preloaded as import torch
    # loads them, give it its symbols (how every torch extension binds).
    module = shared(odd / "module.so", f"{alias('now', COW_NOW)} int h(void){{return now();}}")
    bound = abi.bind(module, python(), [str(lib / "libc10.so")], env={})
    assert bound.ok and bound.unresolved == [], bound
