"""Which cuDNN libraries a process maps, from which directories and releases, which ones a
by-name load would get through ``LD_LIBRARY_PATH``, and the one it uses (``loaded_cudnn``).

Why: cuDNN 9 is split into sub-libraries (``libcudnn.so.9``, ``libcudnn_graph``,
``libcudnn_ops``, ``libcudnn_heuristic``, the engines, ...) that bind each other's versioned
symbols, so every one of them must come from one release. ``libcudnn.so.9`` carries an
``RPATH`` of ``$ORIGIN`` and loads its sub-libraries from its own directory, but the
sub-libraries carry a ``RUNPATH``, which the loader searches *after* ``LD_LIBRARY_PATH``: when
something loads a sub-library by path (Transformer Engine's import loads every file of the
venv's ``nvidia/cudnn/lib``) its ``libcudnn_graph.so.9`` comes from the first
``LD_LIBRARY_PATH`` directory that has one. With a base image's older cuDNN there, the process
either mixes two releases or fails with ``undefined symbol ..., version libcudnn_graph.so.9``;
a failed load is rolled back, so the process may look clean afterwards, and only the search
path still shows the cause. Every look here is bounded: the maps, the named files in the
``LD_LIBRARY_PATH`` directories, the cuDNN lib directory itself and its wheel's dist-info.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import os
import re
from pathlib import Path
from typing import Any

from ep_image.probes._mapped import mapped_libraries
from ep_image.probes._versions import parse_version_triplet

#: Base names of cuDNN's libraries: ``libcudnn.so.9``, ``libcudnn_graph.so.9.14.0``, ...
CUDNN_NAME = r"^libcudnn(_[a-z_]+)?\.so"
#: The loader's names for them (the sonames sub-libraries ask for): ``libcudnn_graph.so.9``.
_SONAME = re.compile(r"^libcudnn(_[a-z_]+)?\.so\.\d+$")
_FILE_VERSION = re.compile(r"\.so\.(\d+\.\d+\.\d+)$")
#: How a cuDNN sub-library of another release shows when the loader binds it.
_FOREIGN_SYMBOL = re.compile(
    r"(?P<lib>/\S+\.so[.\d]*): undefined symbol: \S+, version (?P<needed>libcudnn\w*\.so\.\d+)"
)
#: What the image sets so that its venv's cuDNN wins (docker/Dockerfile): named in fix lines.
IMAGE_ORDERING = (
    "the image sets LD_LIBRARY_PATH=/opt/venvs/active-cudnn/lib:... and "
    "CUDNN_PATH=/opt/venvs/active-cudnn"
)


@dataclasses.dataclass
class CudnnFile:
    """One cuDNN library file: where it is and which release it belongs to, if readable."""

    path: str
    version: str | None
    version_from: str

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    @property
    def dir(self) -> str:
        return os.path.dirname(self.path)

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "dir": self.dir,
            "version": self.version,
            "version_from": self.version_from,
        }


def loader_search_path() -> str:
    """``LD_LIBRARY_PATH`` as the dynamic loader read it when this process started.

    From ``/proc/self/environ`` (the loader never sees later changes to ``os.environ``);
    ``os.environ``'s value where that cannot be read.
    """
    try:
        raw = Path("/proc/self/environ").read_bytes()
    except OSError:
        return os.environ.get("LD_LIBRARY_PATH", "")
    for entry in raw.split(b"\0"):
        if entry.startswith(b"LD_LIBRARY_PATH="):
            return entry.split(b"=", 1)[1].decode(errors="replace")
    return ""


def wheel_lib_dir() -> str | None:
    """This environment's cuDNN wheel directory (``site-packages/nvidia/cudnn/lib``), if any."""
    try:
        spec = importlib.util.find_spec("nvidia.cudnn")
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        lib = Path(location) / "lib"
        if lib.is_dir():
            return os.path.realpath(lib)
    return None


def file_version(path: str, mapped: bool = False) -> tuple[str | None, str]:
    """``(version, how it was read)`` of a cuDNN library file, without loading it.

    The file the soname resolves to (``libcudnn_graph.so.9 -> libcudnn_graph.so.9.14.0``);
    else the wheel that installed it (a wheel's files carry only the soname); else, for a file
    this process already ``mapped`` that exports it, ``cudnnGetVersion``. ``libcudnn.so.9``'s
    answer is its ``libcudnn_graph``'s, so in a mixed process it may name the other release.
    """
    match = _FILE_VERSION.search(os.path.basename(os.path.realpath(path)))
    if match:
        return match.group(1), "file name"
    wheel = _wheel_version(path)
    if wheel:
        return wheel
    if mapped:
        raw, _error = cudnn_version_at(path)
        if raw:
            return "{}.{}.{}".format(*decode_cudnn_version(raw)), "cudnnGetVersion"
    return None, ""


def _wheel_version(path: str) -> tuple[str, str] | None:
    """The nvidia-cudnn wheel whose RECORD lists ``path`` (``site/nvidia/cudnn/lib/<name>``)."""
    lib = Path(path).parent
    if lib.parts[-3:] != ("nvidia", "cudnn", "lib"):
        return None
    site = lib.parents[2]
    entry = f"nvidia/cudnn/lib/{Path(path).name},"
    for dist_info in sorted(site.glob("nvidia_cudnn_cu*.dist-info")):
        try:
            if entry not in (dist_info / "RECORD").read_text(encoding="utf-8"):
                continue
            meta = (dist_info / "METADATA").read_text(encoding="utf-8")
        except OSError:
            continue
        version = re.search(r"^Version:\s*(\S+)", meta, re.MULTILINE)
        triplet = parse_version_triplet(version.group(1) if version else None)
        if triplet:
            return "{}.{}.{}".format(*triplet), f"wheel {dist_info.name.removesuffix('.dist-info')}"
    return None


def first_on_search_path(name: str, search_path: str) -> tuple[str, int] | None:
    """``(file, index)``: the first ``LD_LIBRARY_PATH`` entry holding ``name``, as the loader
    looks, before a library's ``RUNPATH``; None when no entry holds it."""
    for index, entry in enumerate(search_path.split(":")):
        if not entry:
            continue
        candidate = os.path.join(entry, name)
        if os.path.isfile(candidate):
            return candidate, index
    return None


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def survey(maps_text: str | None = None, search_path: str | None = None) -> dict[str, Any]:
    """Every cuDNN library mapped in this process (or in ``maps_text``), grouped by directory
    with each directory's release, and the libraries that ``LD_LIBRARY_PATH`` (``search_path``,
    default: the loader's) would give a by-name load instead of the loaded directory's own.

    ``shadowed`` lists only files of another release (or of one that cannot be read): a copy
    of the same release elsewhere on the path is harmless.
    """
    search_path = loader_search_path() if search_path is None else search_path
    files = [
        CudnnFile(p, *file_version(p, mapped=maps_text is None))
        for p in mapped_libraries(CUDNN_NAME, maps_text)
    ]
    dirs: dict[str, str | None] = {}
    for f in files:
        if dirs.get(f.dir) is None:
            dirs[f.dir] = f.version
    main = next((f for f in files if re.match(r"^libcudnn\.so", f.name)), None)
    home = wheel_lib_dir()
    reference = main.dir if main else (home or (files[0].dir if files else None))
    shadowed = []
    release = dirs.get(reference) if reference else None
    if reference:
        try:
            names = sorted(n for n in os.listdir(reference) if _SONAME.match(n))
        except OSError:
            names = []
        for name in names if release is None else []:
            release = file_version(os.path.join(reference, name))[0]
            if release:
                break
        for name in names:
            found = first_on_search_path(name, search_path)
            if found is None or _same_file(found[0], os.path.join(reference, name)):
                continue
            path = os.path.realpath(found[0])
            version, how = file_version(path)
            if version is not None and version == release:
                continue
            shadowed.append({"name": name, "path": path, "dir": os.path.dirname(path),
                             "version": version, "version_from": how,
                             "search_path_index": found[1]})  # fmt: skip
    return {
        "mapped": [f.to_json() for f in files],
        "dirs": dirs,
        "reference_dir": reference,
        "reference_version": release,
        "wheel_dir": home,
        "search_path": search_path,
        "shadowed": shadowed,
    }


def judge(libs: dict[str, Any]) -> tuple[str, str] | None:
    """``(detail, hint)`` when the process mixes cuDNN directories or ``LD_LIBRARY_PATH``
    shadows the loaded cuDNN's sub-libraries with another release; None when neither.

    The hint names the cause: a directory on ``LD_LIBRARY_PATH`` found before the venv's.
    """
    dirs: dict[str, str | None] = libs["dirs"]
    shadowed: list[dict[str, Any]] = libs["shadowed"]
    if len(dirs) <= 1 and not shadowed:
        return None
    parts = []
    if len(dirs) > 1:
        by_dir = {d: [m["path"] for m in libs["mapped"] if m["dir"] == d] for d in dirs}
        listed = "; ".join(
            f"{d} ({dirs[d] or 'release unknown'}): "
            + ", ".join(os.path.basename(p) for p in paths)
            for d, paths in by_dir.items()
        )
        parts.append(f"cuDNN libraries from {len(dirs)} directories are mapped: {listed}")
    if shadowed:
        found: dict[str, list[dict[str, Any]]] = {}
        for s in shadowed:
            found.setdefault(s["dir"], []).append(s)
        listed = "; ".join(
            f"{d} ({items[0]['version'] or 'release unknown'}): "
            + ", ".join(s["name"] for s in items)
            for d, items in found.items()
        )
        parts.append(
            "LD_LIBRARY_PATH finds another cuDNN before the loaded one "
            f"({libs['reference_dir']}, {libs['reference_version'] or 'release unknown'}), "
            f"so a sub-library loaded by path binds to it: {listed}"
        )
    home = libs["wheel_dir"] or libs["reference_dir"]
    others = sorted({*(d for d in dirs if d != home), *(s["dir"] for s in shadowed)})
    return "; ".join(parts), fix_line(home, others, libs["search_path"])


def fix_line(home: str | None, others: list[str], search_path: str) -> str:
    """One line naming why another cuDNN wins over ``home`` and what to change."""
    entries = [os.path.realpath(e) for e in search_path.split(":") if e]
    on_path = [o for o in others if os.path.realpath(o) in entries]
    home_text = home or "the venv's nvidia/cudnn/lib"
    if on_path:
        return (
            f"another cuDNN ({', '.join(on_path)}) is found before the venv's ({home_text}) "
            f"through LD_LIBRARY_PATH: put {home_text} first on LD_LIBRARY_PATH "
            f"({IMAGE_ORDERING}) or remove {', '.join(on_path)} from LD_LIBRARY_PATH"
        )
    return (
        f"{', '.join(others) or 'another cuDNN'} got into this process outside LD_LIBRARY_PATH "
        "(by path: CUDNN_PATH, CUDNN_HOME, LD_PRELOAD, a program's own load; or by name from "
        f"the loader's cache, /etc/ld.so.conf.d): load every libcudnn from the venv's "
        f"{home_text} ({IMAGE_ORDERING})"
    )


def foreign_sublibrary(error: str, search_path: str | None = None) -> tuple[str, str] | None:
    """For a load error ``<lib>: undefined symbol: ..., version libcudnn_<x>.so.9`` (a cuDNN
    library bound to a sub-library of another release): ``(detail, fix line)`` naming where the
    loader found that sub-library; None for any other error."""
    match = _FOREIGN_SYMBOL.search(error)
    if match is None:
        return None
    search_path = loader_search_path() if search_path is None else search_path
    lib_dir = os.path.realpath(os.path.dirname(match.group("lib")))
    needed = match.group("needed")
    version, _how = file_version(match.group("lib"))
    found = first_on_search_path(needed, search_path)
    if found is None or _same_file(found[0], os.path.join(lib_dir, needed)):
        return (
            f"{needed} that {match.group('lib')} ({version or 'release unknown'}) was bound to "
            "comes from another cuDNN release",
            fix_line(lib_dir, [], search_path),
        )
    other = os.path.realpath(found[0])
    other_version, _ = file_version(other)
    return (
        f"{needed} came from {other} ({other_version or 'release unknown'}) through "
        f"LD_LIBRARY_PATH, not from {lib_dir} ({version or 'release unknown'})",
        fix_line(lib_dir, [os.path.dirname(other)], search_path),
    )


def loaded_cudnn(load_if_absent: bool = True) -> dict[str, Any]:
    """The cuDNN library this process actually uses: its path and ``cudnnGetVersion()``.

    The library is looked up in ``/proc/self/maps`` (what the dynamic loader chose, which is
    the whole question when two copies exist); ``load_if_absent`` loads ``libcudnn.so.9``
    by soname first, as torch would. Returns ``{"path": None, ...}`` when there is none.
    """
    paths = mapped_libraries(r"^libcudnn\.so")
    if not paths and load_if_absent:
        for soname in ("libcudnn.so.9", "libcudnn.so.8", "libcudnn.so"):
            try:
                ctypes.CDLL(soname)
                break
            except OSError:
                continue
        paths = mapped_libraries(r"^libcudnn\.so")
    info: dict[str, Any] = {"path": None, "version": None, "all_mapped": paths, "versions": {}}
    if not paths:
        return info
    for path in paths:
        raw, error = cudnn_version_at(path)
        info["versions"][path] = "{}.{}.{}".format(*decode_cudnn_version(raw)) if raw else None
        if path == paths[0]:
            info["path"] = path
            if raw is None:
                info["error"] = error
            else:
                info["raw"] = raw
                info["version"] = info["versions"][path]
    return info


def cudnn_version_at(path: str) -> tuple[int | None, str | None]:
    """``cudnnGetVersion()`` of the library file at ``path`` (already mapped: same handle)."""
    try:
        lib = ctypes.CDLL(path)
        lib.cudnnGetVersion.restype = ctypes.c_size_t
        return int(lib.cudnnGetVersion()), None
    except (OSError, AttributeError) as exc:
        return None, f"cudnnGetVersion failed: {exc}"


def decode_cudnn_version(value: int) -> tuple[int, int, int]:
    """``cudnnGetVersion()``'s integer as (major, minor, patch).

    cuDNN 9 encodes ``major*10000 + minor*100 + patch`` (9.20.0 -> 92000); cuDNN 8 and older
    encoded ``major*1000 + minor*100 + patch`` (8.9.7 -> 8907).
    """
    if value >= 90000:
        return value // 10000, (value % 10000) // 100, value % 100
    return value // 1000, (value % 1000) // 100, value % 100
