"""Prebuilt wheels of the source builds (TE, DeepEP v1, HybridEP), taken only when they match.

Why: compiling TE and the DeepEP builds takes an hour of nvcc on a small builder, so a CI cache
(or a bigger machine) compiles once and later builds take the wheels. A wheel built from another
commit, torch, cuDNN, NVSHMEM, arch list or build setting imports fine and fails on the GPU, so
each wheel travels with the record of what it was built from, and a build compares that record
with its own inputs before it installs the wheel; on any difference it compiles, saying which.
Standard library only: the image's stages use it before anything else is installed.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ep_image.files.records import sha256_file
from ep_image.pins import normalize, read_toml

#: A DeepEP build's record beside its wheel: ``<backend>-wheel.json``.
BACKEND_RECORD_SUFFIX = "-wheel.json"
#: The distributions a source build compiles or links against, whose locked versions and
#: hashes a record must name: the same lock entries give the same headers and libraries.
BUILD_INPUTS = {
    "deep-ep": ("torch", "nvidia-nvshmem-cu13", "nvidia-nccl-cu13"),
    "transformer-engine": (
        "torch",
        "nvidia-cudnn-cu13",
        "nvidia-cudnn-frontend",
        "nvidia-nccl-cu13",
    ),
}


def python_tag(version: tuple[int, int] | None = None) -> str:
    """The wheel tag of this interpreter's ABI (``cp311``): a wheel of another is refused."""
    major, minor = version or sys.version_info[:2]
    return f"cp{major}{minor}"


def wheel_python_tag(wheel_name: str) -> str | None:
    """The python tag of a wheel file name (``deep_ep-1.2.1-cp311-cp311-linux_x86_64.whl``)."""
    parts = wheel_name[: -len(".whl")].split("-") if wheel_name.endswith(".whl") else []
    return parts[-3] if len(parts) >= 5 else None


def locked_inputs(project: Path, distribution: str) -> dict[str, str]:
    """``{name: "version sha256:..."}`` of what ``distribution``'s build links against, from
    uv.lock (every version of a name the lock holds, joined, when extras fork it)."""
    wanted = BUILD_INPUTS[normalize(distribution)]
    lock = read_toml(project / "uv.lock")
    found: dict[str, list[str]] = {}
    for package in lock.get("package", []):
        name = normalize(package["name"])
        if name not in wanted:
            continue
        hashes = sorted(w.get("hash", "") for w in package.get("wheels", []))
        digest = hashes[0] if hashes else str(package.get("source"))
        found.setdefault(name, []).append(f"{package['version']} {digest}")
    return {name: " | ".join(sorted(found[name])) for name in wanted if name in found}


@dataclass(frozen=True)
class Candidate:
    """A wheel and the record beside it."""

    record_path: Path
    record: dict[str, Any]

    @property
    def wheel(self) -> Path:
        return self.record_path.parent / str(self.record.get("wheel"))


@dataclass(frozen=True)
class Choice:
    """What a build takes: a wheel whose record matched, or nothing and why."""

    wheel: Path | None
    record: dict[str, Any] | None
    reasons: tuple[str, ...]

    def say(self, prog: str, what: str, directory: Path) -> str:
        """One line for the build's log."""
        if self.wheel is not None:
            return (
                f"{prog}: {what}: using the prebuilt {self.wheel.name} from {directory} (its "
                "record matches this build)"
            )
        why = "; ".join(self.reasons) or "none found"
        return f"{prog}: {what}: compiling; no prebuilt wheel in {directory} matches: {why}"


def candidates(directory: Path, record_names: Iterable[str]) -> list[Candidate]:
    """The readable records named ``record_names`` in ``directory``."""
    found = []
    for name in record_names:
        path = directory / name
        try:
            found.append(Candidate(path, json.loads(path.read_text())))
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as exc:
            found.append(Candidate(path, {"unreadable": str(exc)}))
    return found


def mismatches(candidate: Candidate, expected: Mapping[str, Any]) -> list[str]:
    """Every way ``candidate`` differs from ``expected`` (field by field), then its wheel's
    file: present, the interpreter's python tag, the recorded sha256. Empty when it matches."""
    record = candidate.record
    where = candidate.record_path.name
    if "unreadable" in record:
        return [f"{where}: unreadable ({record['unreadable']})"]
    problems = [
        f"{where}: {key} is {record.get(key)!r}, this build's is {value!r}"
        for key, value in expected.items()
        if record.get(key) != value
    ]
    wheel = candidate.wheel
    tag = wheel_python_tag(wheel.name)
    if not record.get("wheel") or not wheel.is_file():
        problems.append(f"{where}: its wheel {record.get('wheel')!r} is not beside it")
    elif tag is not None and tag != python_tag():
        problems.append(f"{where}: {wheel.name} is for {tag}, this Python is {python_tag()}")
    elif sha256_file(wheel) != record.get("wheel_sha256"):
        problems.append(f"{where}: {wheel.name} is not the wheel it records (sha256 differs)")
    return problems


def choose(
    directory: Path | None, record_names: Iterable[str], expected: Mapping[str, Any]
) -> Choice:
    """The first candidate in ``directory`` that matches ``expected``, else why none did.
    No directory, or one without records (the Dockerfile's default holds only a README), is
    an empty choice that names no problem."""
    if directory is None or not directory.is_dir():
        return Choice(None, None, ())
    reasons: list[str] = []
    for candidate in candidates(directory, record_names):
        found = mismatches(candidate, expected)
        if not found:
            return Choice(candidate.wheel.resolve(), candidate.record, ())
        reasons += found
    return Choice(None, None, tuple(reasons))


def arch_list_key(arch_list: str | None) -> str | None:
    """``TORCH_CUDA_ARCH_LIST`` in one spelling (``9.0;10.0``): spaces and ``;`` both separate."""
    if arch_list is None:
        return None
    return ";".join(a for a in re.split(r"[;\s]+", arch_list.strip()) if a)
