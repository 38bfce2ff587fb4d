"""Does a venv's compiled code bind to the torch, NCCL, ... that venv holds? Symbols, not files.

The loader answers without a GPU or running any code: in trace mode with ``LD_BIND_NOW`` it maps
each extension as ``import`` does and names every symbol it cannot bind. Standard library only.
See docs/backends.md, section "Checking the ABI without a GPU".
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ep_image.native import elf, loader

#: Provided by the GPU driver at run time, never by a venv; a toolkit stub may stand in.
DRIVER_LIBS = {"libcuda.so.1": "libcuda.so", "libnvidia-ml.so.1": "libnvidia-ml.so"}
#: torch's C++ namespaces, as they start a mangled name (``_ZN3c10``, ``_ZNK2at``, ``_ZTVN5torch``).
TORCH_NAMESPACES = frozenset({"c10", "at", "torch", "caffe2"})
_MANGLED_NAMESPACE = re.compile(r"^_Z(?:T[VIST])?N?[rVKRO]*(\d+)")
_UNDEFINED = re.compile(r"undefined symbol: (?P<symbol>\S+)\s+\((?P<object>[^)]+)\)")
_VERSION = re.compile(
    r"version [`'](?P<version>[^`']+)' not found \(required by (?P<object>[^)]+)\)"
)


@dataclass(frozen=True)
class Unresolved:
    """A symbol an object needs and no mapped library exports."""

    symbol: str
    needed_by: str
    origin: str  # "torch" (its C++ namespaces), "driver" (cu*/nvml*), or "other"
    demangled: str = ""


@dataclass
class ExtensionAbi:
    """The loader's verdict on one compiled extension in its venv."""

    extension: str
    unresolved: list[Unresolved] = field(default_factory=list)
    version_errors: list[str] = field(default_factory=list)
    not_found: list[str] = field(default_factory=list)  # libraries, driver ones left out
    stand_ins: dict[str, str] = field(default_factory=dict)  # driver soname -> stub used
    #: How libcuda.so.1 was mapped: "real" (the driver's), "stub" (the toolkit's), "absent",
    #: or "not linked" (nothing mapped needs it: the code reaches the driver through the runtime)
    driver: str = "real"
    #: libstdc++ linked in statically (see ``carries_cxx_runtime``)
    static_cxx_runtime: bool = False

    @property
    def complete(self) -> bool:
        """Every library but the driver's was found, so every symbol could be judged."""
        return not self.not_found

    @property
    def failures(self) -> list[Unresolved]:
        """Unresolved symbols that fail the import for sure. torch's always (its libraries are
        all there); others only when every library was found (a missing one may export them,
        e.g. in a venv that leaves packages out); the driver's against the real driver, or when
        nothing links it at all (a build against an incomplete stub, whose linker dropped it)."""
        return [
            u
            for u in self.unresolved
            if u.origin == "torch"
            or (u.origin == "other" and self.complete)
            or (u.origin == "driver" and self.driver in ("real", "not linked"))
        ]

    @property
    def ok(self) -> bool:
        """Nothing that was judged fails to bind (libraries not found are ``complete``'s)."""
        return not (self.failures or self.version_errors or self.static_cxx_runtime)

    def problems(self, torch_version: str | None, strict: bool = True) -> list[str]:
        """One line per failure, each naming the symbol and the fix; with ``strict``, also each
        library not found (a venv that leaves packages out passes ``strict=False``)."""
        lines = []
        name = Path(self.extension).name
        torch_ones = [u for u in self.failures if u.origin == "torch"]
        if torch_ones:
            first = torch_ones[0]
            lines.append(
                f"{name} was built against another torch: it needs {len(torch_ones)} symbol(s) "
                f"that this venv's torch {torch_version or '(version unknown)'} does not export, "
                f"e.g. {first.demangled or first.symbol} ({first.symbol}). Fix: build it from "
                "source against this venv's torch, or pin a wheel built for this torch "
                "(one that declares it in its requirements)"
            )
        others = [u for u in self.failures if u.origin != "torch"]
        if others:
            by = sorted({Path(u.needed_by).name for u in others})
            lines.append(
                f"{name}: {', '.join(by)} need(s) {len(others)} symbol(s) that no library in "
                f"this venv exports, e.g. {others[0].symbol} (needed by "
                f"{Path(others[0].needed_by).name}): built against other versions of its "
                "libraries (e.g. NCCL, NVSHMEM, the CUDA runtime). Fix: pin the versions it was "
                "built for, or rebuild it against this venv's"
            )
        if self.static_cxx_runtime:
            lines.append(
                f"{name} carries its own libstdc++ (linked with -static-libstdc++, e.g. by a "
                "compiler wrapper such as a CUDAHOSTCXX or CXX that adds it): a second C++ "
                "runtime beside torch's, which crashes at run time (HybridEP did, in its buffer "
                "constructor). Fix: rebuild with the system compiler (CC=/usr/bin/gcc "
                "CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++)"
            )
        lines += [f"{name}: {error}. Fix: a build for this system's libraries" for error in
                  self.version_errors]  # fmt: skip
        if strict:
            lines += [
                f"{name}: {lib} is not found by the dynamic loader, so its symbols cannot bind. "
                "Fix: install the package that ships it"
                for lib in self.not_found
            ]
        return lines

    def to_json(self) -> dict[str, object]:
        data = asdict(self)
        data["ok"], data["complete"] = self.ok, self.complete
        return data


def symbol_origin(symbol: str) -> str:
    """Where a symbol comes from, judged by its name: torch's C++ namespaces, the driver's C API
    (``cu*``, ``nvml*``), or elsewhere."""
    match = _MANGLED_NAMESPACE.match(symbol)
    if match:
        length = int(match.group(1))
        start = match.end()
        if symbol[start : start + length] in TORCH_NAMESPACES:
            return "torch"
    if re.match(r"^(cu[A-Z]|nvml[A-Z])", symbol):
        return "driver"
    return "other"


def demangle(symbols: list[str]) -> dict[str, str]:
    """C++ names for mangled ``symbols`` through binutils' ``c++filt``, where it is installed."""
    tool = shutil.which("c++filt")
    mangled = [s for s in symbols if s.startswith("_Z")]
    if not tool or not mangled:
        return {}
    proc = subprocess.run(
        [tool], input="\n".join(mangled), capture_output=True, text=True, check=False
    )
    names = proc.stdout.splitlines()
    return dict(zip(mangled, names, strict=False)) if proc.returncode == 0 else {}


def driver_stubs(env: dict[str, str] | None = None) -> dict[str, str]:
    """The CUDA toolkit's stubs of the driver libraries (soname -> path), for a host without a
    driver: they export the driver API of that toolkit, so symbols can still be bound."""
    environ = os.environ if env is None else env
    home = Path(environ.get("CUDA_HOME") or "/usr/local/cuda")
    dirs = [home / "lib64" / "stubs", *sorted(home.glob("targets/*/lib/stubs"))]
    stubs = {}
    for soname, stub in DRIVER_LIBS.items():
        found = next((d / stub for d in dirs if (d / stub).is_file()), None)
        if found is not None:
            stubs[soname] = str(found)
    return stubs


def bind(
    extension: Path, python: Path, preload: list[str], env: dict[str, str] | None = None
) -> ExtensionAbi:
    """Map ``extension`` as importing it would (``preload`` first, under ``python``) and bind
    every symbol; what could not be bound is the result."""
    result = ExtensionAbi(extension=str(extension))
    result.static_cxx_runtime = carries_cxx_runtime(extension)
    found, missing = loader.resolve(extension, preload)
    absent = {lib for lib, where in found.items() if where is None} | set(missing)
    stubs = driver_stubs(env)
    stand_ins = [lib for lib in DRIVER_LIBS if lib in absent and lib in stubs]
    result.stand_ins = {lib: stubs[lib] for lib in stand_ins}
    result.not_found = sorted(absent - set(DRIVER_LIBS))
    if "libcuda.so.1" in absent:
        result.driver = "stub" if "libcuda.so.1" in stubs else "absent"
    elif "libcuda.so.1" not in found and not any(
        Path(p).name.startswith("libcuda.so") for p in loader.closure(extension, preload)
    ):
        result.driver = "not linked"
    with loader.SafeNames() as safe:
        objects = [*result.stand_ins.values(), *preload, str(extension)]
        environment = {
            **(os.environ if env is None else env),
            "LD_TRACE_LOADED_OBJECTS": "1",
            "LD_BIND_NOW": "1",
            "LD_WARN": "1",
            "LD_PRELOAD": " ".join(safe.path(p) for p in objects),
        }
        # The interpreter the venv's python links to, as exec would find it (its $ORIGIN).
        program = safe.path(os.path.realpath(python))
        proc = subprocess.run(
            [loader.loader(), program], capture_output=True, text=True, env=environment,
            check=False,
        )  # fmt: skip
    output = proc.stdout + "\n" + proc.stderr  # read line by line, paths mapped back after
    if proc.returncode != 0 and "undefined symbol" not in output:
        raise loader.LoaderError(
            f"the loader cannot bind {extension}: {safe.real(output.strip()) or proc.returncode}"
        )
    seen: set[tuple[str, str]] = set()
    for line in output.splitlines():
        if match := _UNDEFINED.search(line):
            needed_by = safe.real(match["object"])
            key = (match["symbol"], needed_by)
            if key not in seen:
                seen.add(key)
                origin = symbol_origin(match["symbol"])
                result.unresolved.append(Unresolved(match["symbol"], needed_by, origin))
        elif match := _VERSION.search(line):
            result.version_errors.append(
                f"version {match['version']} not found (required by {safe.real(match['object'])})"
            )
    names = demangle([u.symbol for u in result.unresolved])
    result.unresolved = [
        Unresolved(u.symbol, u.needed_by, u.origin, names.get(u.symbol, ""))
        for u in result.unresolved
    ]
    return result


def distribution_extensions(site: Path, distributions: Iterable[str]) -> list[Path]:
    """The compiled objects (``*.so``, ``*.so.N``) the given distributions installed, read from
    their ``RECORD`` files: what their import may map."""
    wanted = {_normalize(d) for d in distributions}
    found: list[Path] = []
    for info in sorted(site.glob("*.dist-info")):
        metadata = info / "METADATA"
        name = _metadata_name(metadata) if metadata.is_file() else None
        if name is None or _normalize(name) not in wanted or not (info / "RECORD").is_file():
            continue
        for line in (info / "RECORD").read_text(errors="replace").splitlines():
            path = line.rsplit(",", 2)[0]
            if re.search(r"\.so(\.\d+)*$", path) and not path.startswith(".."):
                candidate = site / path
                if candidate.is_file():
                    found.append(candidate)
    return found


def check(
    site: Path,
    python: Path,
    distributions: Iterable[str],
    env: dict[str, str] | None = None,
) -> list[ExtensionAbi]:
    """Bind every compiled extension of ``distributions`` in the venv whose site-packages is
    ``site``, with torch's libraries loaded first, as ``import`` would.

    A distribution's own plain libraries (``lib*.so``, not Python modules) are loaded before its
    Python extension modules too: its package loads them globally first (TE's ``__init__``
    dlopens ``libtransformer_engine.so``, whose symbols ``transformer_engine_torch`` uses
    without naming the library)."""
    torch_libs = None
    results = []
    for distribution in distributions:
        extensions = distribution_extensions(site, [distribution])
        if not extensions:
            continue
        if torch_libs is None:
            torch_libs = loader.torch_first(site)
        own = [str(p) for p in extensions if not is_python_module(p)]
        for ext in extensions:
            first = [*torch_libs, *own] if is_python_module(ext) else torch_libs
            results.append(bind(ext, python, [p for p in first if p != str(ext)], env))
    return results


def is_python_module(path: Path) -> bool:
    """An extension module ``import`` loads (``name.cpython-312-x86_64-linux-gnu.so``,
    ``name.abi3.so``), as opposed to a library the package loads itself."""
    return not path.name.startswith("lib") or ".cpython-" in path.name or ".abi3." in path.name


def carries_cxx_runtime(path: Path) -> bool:
    """Whether a shared object has libstdc++ linked in: ``std::`` code inside and no
    ``libstdc++.so.6`` asked of the loader. A compiler wrapper that adds ``-static-libstdc++``
    builds such a thing; beside torch's shared libstdc++ it crashes in iostream code."""
    try:
        needed = elf.read_dynamic(path).needed
    except (OSError, elf.ElfError):
        return False
    if any(lib.startswith("libstdc++.so") for lib in needed):
        return False
    with path.open("rb") as fh:
        tail = b""
        while block := fh.read(1 << 22):
            if b"_ZNSt" in tail + block:
                return True
            tail = block[-4:]
    return False


def torch_version(site: Path) -> str | None:
    """The installed torch's version, from its dist-info."""
    for info in site.glob("torch-*.dist-info"):
        return info.name[len("torch-") : -len(".dist-info")]
    return None


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _metadata_name(metadata: Path) -> str | None:
    with metadata.open(errors="replace") as handle:
        for line in handle:
            if line.startswith("Name:"):
                return line.split(":", 1)[1].strip()
            if not line.strip():
                break
    return None
