"""The Transformer Engine source tree build_te compiles: what it holds, what it lacks, which commit.

Why a module of its own: plain snapshots of TE lack its git submodules, and a checkout may sit
at another commit than the one pyproject.toml pins; these checks name what is missing (and link
in the cuDNN frontend headers from the lock's wheel where only those are) before minutes of
CMake, and the clone fetches the pinned commit where no checkout is given.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ep_image.build_steps._te_wheels import TE_DISTRIBUTION
from ep_image.build_steps._venv.cudnn import dist_version
from ep_image.build_steps._venv.layout import site_packages
from ep_image.pins import PinError, pinned_git

FRONTEND_DIST = "nvidia-cudnn-frontend"


class BuildTeError(RuntimeError):
    """A problem with the TE build the user can fix; the message says how."""


@dataclass(frozen=True)
class Frontend:
    """cuDNN frontend headers (header-only C++ API TE compiles against)."""

    include: Path
    version: str
    origin: str


@dataclass
class SourceCheck:
    """What the TE source tree lacks, and what build_te will link in for it."""

    missing: list[str] = field(default_factory=list)
    links: dict[str, Path] = field(default_factory=dict)
    frontend: Frontend | None = None


# --- what the tree holds ------------------------------------------------------------------------


def te_version(source: Path) -> str:
    """TE's version from build_tools/VERSION.txt."""
    version_file = source / "build_tools" / "VERSION.txt"
    if not (source / "setup.py").is_file() or not version_file.is_file():
        raise BuildTeError(
            f"{source} is not a TransformerEngine source tree (no setup.py or "
            "build_tools/VERSION.txt). Fix: clone it at the commit pinned in pyproject.toml "
            "[tool.uv.sources]: `git clone --recurse-submodules "
            "https://github.com/NVIDIA/TransformerEngine && git -C TransformerEngine checkout "
            "<rev> && git -C TransformerEngine submodule update --init --recursive`."
        )
    return version_file.read_text(encoding="utf-8").strip()


def find_frontend(venv: Path) -> Frontend | None:
    """The nvidia-cudnn-frontend wheel's headers (site-packages/include), if installed."""
    site = site_packages(venv)
    installed = dist_version(site, FRONTEND_DIST)
    header = site / "include" / "cudnn_frontend.h"
    if installed is None or not header.is_file():
        return None
    return Frontend(site / "include", installed, f"venv:{FRONTEND_DIST}")


def nccl_ep_wanted(env: Mapping[str, str], nvte_archs: str) -> bool:
    """Mirror of TE's nccl_ep_enabled(): on by default when an arch >= 90 is targeted."""
    if env.get("NVTE_WITH_NCCL_EP", "1") == "0":
        return False
    return any(int(re.sub(r"[af]$", "", a)) >= 90 for a in nvte_archs.split(";") if a)


def check_source(source: Path, frontend: Frontend | None, need_nccl: bool) -> SourceCheck:
    """Name what TE's CMake needs from the submodules and is absent; plan frontend links."""
    third = source / "3rdparty"
    check = SourceCheck()
    fe_include = third / "cudnn-frontend" / "include"
    if (fe_include / "cudnn_frontend.h").is_file():
        check.frontend = Frontend(fe_include, frontend_header_version(fe_include), "submodule")
    elif frontend is not None:
        check.links[str(fe_include.relative_to(source))] = frontend.include
        check.frontend = frontend
    else:
        check.missing.append(
            f"3rdparty/cudnn-frontend/include (submodule; or install {FRONTEND_DIST} in the venv)"
        )
    if not (third / "cudnn-frontend" / "cmake" / "cuDNN.cmake").is_file():
        check.missing.append("3rdparty/cudnn-frontend/cmake/cuDNN.cmake (submodule)")
    if not (third / "cutlass" / "include" / "cutlass" / "cutlass.h").is_file():
        check.missing.append("3rdparty/cutlass/include (submodule)")
    if need_nccl and not (third / "nccl" / "Makefile").is_file():
        check.missing.append(
            "3rdparty/nccl (submodule; needed for NCCL EP with archs >= 9.0, "
            "or set NVTE_WITH_NCCL_EP=0)"
        )
    return check


def frontend_header_version(include: Path) -> str:
    """cudnn-frontend version from cudnn_frontend_version.h, or 'unknown'."""
    header = include / "cudnn_frontend_version.h"
    if not header.is_file():
        return "unknown"
    text = header.read_text(encoding="utf-8", errors="replace")
    parts = [
        re.search(rf"#define CUDNN_FRONTEND_{p}_VERSION\s+(\d+)", text)
        for p in ("MAJOR", "MINOR", "PATCH")
    ]
    return ".".join(m.group(1) for m in parts) if all(parts) else "unknown"


def pinned_frontend(source: Path) -> str | None:
    """The cudnn-frontend commit TE's own tree pins (its submodule entry), if it is a git tree."""
    if not (source / ".git").exists() or shutil.which("git") is None:
        return None
    out = subprocess.run(
        ["git", "-C", str(source), "ls-tree", "HEAD", "3rdparty/cudnn-frontend"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    fields = out.stdout.split()
    return fields[2] if out.returncode == 0 and len(fields) >= 3 else None


def frontend_commit(source: Path) -> str | None:
    """HEAD of the cudnn-frontend submodule, if it is a git checkout of its own."""
    fe = source / "3rdparty" / "cudnn-frontend"
    if not (fe / ".git").exists() or shutil.which("git") is None:
        return None
    out = subprocess.run(
        ["git", "-C", str(fe), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    )
    return out.stdout.strip() or None if out.returncode == 0 else None


def frontend_note(record: Mapping[str, object]) -> str | None:
    """One line when the frontend compiled is not TE's pinned submodule (None when it is, or
    when the tree does not say what it pins)."""
    pinned, used = record.get("cudnn_frontend_pinned"), record.get("cudnn_frontend_commit")
    if not pinned or used == pinned:
        return None
    return (
        f"the cudnn-frontend compiled is {record.get('cudnn_frontend_version')} from "
        f"{record.get('cudnn_frontend_origin')} (commit {used or 'unknown'}), not the submodule "
        f"TE pins ({str(pinned)[:12]})"
    )


def apply_links(source: Path, links: Mapping[str, Path]) -> None:
    """Create the planned symlinks (only where the path is absent, an empty directory, or a
    link that does not give the headers: an earlier build's link into its throwaway venv,
    gone with it, made a rerun fail with FileExistsError)."""
    for rel, target in links.items():
        path = source / rel
        if path.is_symlink():
            path.unlink()
        elif path.is_dir():
            path.rmdir()  # an uninitialised submodule leaves an empty directory
        path.parent.mkdir(parents=True, exist_ok=True)
        path.symlink_to(target, target_is_directory=True)
        print(f"build_te: linked {path} -> {target}")


# --- which commit -------------------------------------------------------------------------------


def pinned_commit(project: Path) -> str | None:
    """The TE commit pinned in pyproject.toml [tool.uv.sources] (the one source of truth)."""
    try:
        return pinned_git(project, TE_DISTRIBUTION)[1]
    except PinError:
        return None


def source_commit(source: Path) -> str | None:
    """HEAD of the TE source if it is a git work tree, else None (a plain snapshot)."""
    if not (source / ".git").exists() or shutil.which("git") is None:
        return None
    result = subprocess.run(
        ["git", "-C", str(source), "rev-parse", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        return None
    return result.stdout.strip() or None


def check_pins(record: Mapping[str, object]) -> None:
    """Refuse to build a TE commit other than the pinned one (two pins must not drift)."""
    pinned, head = record["te_commit_pinned"], record["te_commit_source"]
    if pinned and head and pinned != head:
        raise BuildTeError(
            f"TE source is at {head} but pyproject.toml pins {pinned}. Fix: "
            f"`git -C SOURCE checkout {pinned} && git -C SOURCE submodule update --init "
            "--recursive`, or change the pin in pyproject.toml."
        )


def run_logged(cmd: Sequence[str], **kw: object) -> None:
    """Run a command, printing it first; its output streams to ours."""
    print("build_te: " + shlex.join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)  # type: ignore[call-overload]


def clone_pinned(project: Path, dest: Path) -> Path:
    """Clone the TE URL + commit pinned in pyproject.toml, submodules included.

    git applies the git config's ``url.<mirror>.insteadOf`` rules (the image passes them as the
    ``gitconfig`` secret), so an air-gapped build clones from its mirror.
    """
    try:
        url, rev = pinned_git(project, TE_DISTRIBUTION)
    except PinError as exc:
        raise BuildTeError(str(exc)) from None
    print(f"build_te: cloning {url} at {rev} (pinned in pyproject.toml)", flush=True)
    try:
        run_logged(["git", "clone", "--quiet", url, str(dest)])
        run_logged(["git", "-C", str(dest), "checkout", "--quiet", rev])
        run_logged(["git", "-C", str(dest), "submodule", "update", "--init", "--recursive"])
    except subprocess.CalledProcessError:
        raise BuildTeError(
            f"cloning {url} at {rev} failed (output above). Fix: give the build access to "
            "github.com, or point git at a mirror that holds the commit and TE's submodules: "
            f"`git config --global url.<mirror>.insteadOf {url}` (image builds: the gitconfig "
            "secret, docs/image.md), or pass --source with a checkout."
        ) from None
    return dest
