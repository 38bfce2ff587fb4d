"""Where the real dynamic loader finds each shared library an ELF file needs.

Runs the loader itself in trace mode, as ``ldd`` does, instead of looking for same-named files;
``preload`` maps first what ``import torch`` loaded, which an extension then reuses by soname.
See docs/backends.md, section "Checking the ABI without a GPU".
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ep_image.native import elf

#: Where glibc's loader lives when `ld.so` is not on PATH (Debian and Ubuntu put it there).
_RTLDS = {
    "x86_64": "/lib64/ld-linux-x86-64.so.2",
    "aarch64": "/lib/ld-linux-aarch64.so.1",
}
_FOUND = re.compile(r"^\s*(?P<name>\S+) => (?P<path>.+?)(?: \(0x[0-9a-f]+\))?$")
_LOADED = re.compile(r"^\s*(?P<path>/.+?) \(0x[0-9a-f]+\)$")
#: What a path handed to the loader may not hold: LD_PRELOAD is split at spaces and colons (no
#: escape exists), and the trace is read line by line.
_UNSAFE = re.compile(r"[\s:]")


class LoaderError(Exception):
    """The loader could not be run, or could not read the file at all."""


@dataclass
class Trace:
    """What one trace printed."""

    found: dict[str, str | None] = field(default_factory=dict)  # name -> path, None: not found
    loaded: list[str] = field(default_factory=list)  # every object mapped, by path


def loader() -> str:
    """glibc's dynamic loader: `ld.so` on PATH, else its standard path for this machine."""
    on_path = shutil.which("ld.so")
    if on_path:
        return os.path.realpath(on_path)
    candidate = _RTLDS.get(platform.machine())
    if candidate and os.path.exists(candidate):
        return candidate
    raise LoaderError(
        "no glibc dynamic loader found (`ld.so` on PATH or "
        f"{candidate or 'its standard path'}): this check needs a glibc Linux system"
    )


class SafeNames:
    """Paths the loader cannot be handed as they are (a space, a colon or a newline in them:
    any a file system allows), each reached instead through a symbolic link to its directory,
    named ``d<N>`` in a temporary directory of this one's; what the loader prints is mapped
    back. A link to the directory, not to the file, keeps ``$ORIGIN`` (a RUNPATH relative to
    the object) pointing where the file is. Use it as a context manager: the links go."""

    def __init__(self) -> None:
        self.base: str | None = None
        self.links: dict[str, str] = {}  # real directory -> its link

    def __enter__(self) -> SafeNames:
        return self

    def __exit__(self, *_exc: object) -> None:
        if self.base is not None:
            shutil.rmtree(self.base, ignore_errors=True)  # the links only, never what they name

    def path(self, real: str | os.PathLike[str]) -> str:
        """``real`` as the loader can take it."""
        text = os.fspath(real)
        if not _UNSAFE.search(text):
            return text
        directory, name = os.path.split(os.path.abspath(text))
        if _UNSAFE.search(name):
            raise LoaderError(
                f"{text!r}: the dynamic loader cannot be handed a file whose own name holds a "
                "space, a colon or a newline (LD_PRELOAD splits at them, with no escape): "
                "rename the file"
            )
        if directory not in self.links:
            if self.base is None:
                self.base = tempfile.mkdtemp(prefix="ld-trace-", dir=_safe_tmp())
            link = os.path.join(self.base, f"d{len(self.links)}")
            os.symlink(directory, link)
            self.links[directory] = link
        return os.path.join(self.links[directory], name)

    def real(self, text: str) -> str:
        """``text`` (a path the loader printed) with a link's path put back as the real one."""
        for directory, link in self.links.items():
            text = text.replace(link + "/", directory + "/")
        return text


def _safe_tmp() -> str:
    """A directory for SafeNames' links whose own path the loader can take."""
    for candidate in (tempfile.gettempdir(), "/tmp", "/var/tmp", "/dev/shm"):
        if not _UNSAFE.search(candidate) and os.path.isdir(candidate):
            return candidate
    raise LoaderError(
        "no temporary directory whose path holds no space, colon or newline: set TMPDIR to one"
    )


def trace(path: Path, preload: Sequence[str] = (), env: dict[str, str] | None = None) -> Trace:
    """Run the loader in trace mode on ``path``, with ``preload`` mapped first."""
    environment = {**(os.environ if env is None else env), "LD_TRACE_LOADED_OBJECTS": "1"}
    environment.pop("LD_PRELOAD", None)
    with SafeNames() as safe:
        if preload:
            environment["LD_PRELOAD"] = " ".join(safe.path(p) for p in preload)
        proc = subprocess.run(
            [loader(), safe.path(path)], capture_output=True, text=True, env=environment,
            check=False,
        )  # fmt: skip
    result = Trace()
    for line in proc.stdout.splitlines():  # lines first: a real path may hold a newline
        if match := _FOUND.match(line):
            where = safe.real(match["path"])
            result.found.setdefault(match["name"], None if where == "not found" else where)
            if where != "not found":
                result.loaded.append(where)
        elif match := _LOADED.match(line):
            result.loaded.append(safe.real(match["path"]))
    if proc.returncode != 0:
        message = safe.real((proc.stderr or proc.stdout).strip()) or f"exit {proc.returncode}"
        raise LoaderError(f"the loader cannot trace {path}: {message}")
    return result


def closure(path: Path, preload: Sequence[str] = ()) -> list[str]:
    """Every object the loader maps for ``path`` (itself included): what importing it loads."""
    return [p for p in trace(path, preload).loaded if os.path.exists(p)]


def torch_first(site: Path) -> list[str]:
    """The objects `import torch` maps, which a torch extension then reuses by soname.

    Every backend's ``deep_ep`` (and TE) imports torch before its extension module, so its
    ``libc10.so``, ``libtorch.so``, NCCL, ... are the ones torch loaded: torch's extension
    module and its global-deps library, traced by the loader in this environment.
    """
    modules = sorted(site.glob("torch/_C.*.so"))
    if not modules:
        return []
    global_deps = [str(p) for p in site.glob("torch/lib/libtorch_global_deps.so")]
    return closure(modules[0], global_deps)


def resolve(path: Path, preload: Sequence[str] = ()) -> tuple[dict[str, str | None], list[str]]:
    """For each DT_NEEDED of ``path``: the file the loader uses (None: not found).

    Also returns the names needed further down (by a dependency of a dependency) that the
    loader did not find: those fail the load just the same.
    """
    result = trace(path, preload)
    by_name: dict[str, str] = {}
    for loaded in result.loaded:
        by_name.setdefault(os.path.basename(loaded), loaded)
    for preloaded in preload:  # satisfied by soname; the trace prints them by path only
        by_name.setdefault(os.path.basename(preloaded), preloaded)
        soname = elf_soname(Path(preloaded))
        if soname:
            by_name.setdefault(soname, preloaded)
    needed = elf_dynamic(path).needed
    direct: dict[str, str | None] = {}
    for name in needed:
        if name in result.found:
            direct[name] = result.found[name]
        else:
            direct[name] = by_name.get(name)
    deeper = sorted(n for n, where in result.found.items() if where is None and n not in direct)
    return direct, deeper


# --------------------------------------------------------------------------- ELF reading


def elf_dynamic(path: Path) -> elf.Dynamic:
    """DT_NEEDED and DT_SONAME (ep_image/native/elf.py), errors as LoaderError."""
    try:
        return elf.read_dynamic(path)
    except elf.ElfError as exc:
        raise LoaderError(str(exc)) from None


def elf_soname(path: Path) -> str | None:
    """DT_SONAME, or None for a file that is not a readable 64-bit ELF object."""
    try:
        return elf_dynamic(path).soname
    except (OSError, LoaderError, ValueError):
        return None
