"""The package's layout holds: imports go one way, nothing edits sys.path, entry points resolve.

docs/architecture.md draws the parts; these tests keep the drawing true.
"""

from __future__ import annotations

import ast
import importlib
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ep_image"


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def room(module: str) -> str:
    """``build_steps`` or ``probes`` for their subpackages; ``library`` for the rest of ep_image."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ("build_steps", "probes") else "library"


def imports(path: Path) -> list[str]:
    """Every ep_image module ``path`` imports (absolute imports; the package uses no others)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: relative import"
            found += [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names]
    return [name for name in found if name.split(".")[0] == "ep_image"]


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_go_one_way(path: Path) -> None:
    """The library (registry, pins, ELF and ABI readers) imports neither the build steps nor the
    probes; the build steps and the probes do not import each other (they meet in subprocesses)."""
    own = room(module_name(path))
    crossing = [name for name in imports(path) if room(name) not in ("library", own)]
    assert not crossing, f"{path.relative_to(ROOT)} ({own}) imports {crossing}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_edits_sys_path(path: Path) -> None:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = ast.unparse(node.func.value)
            assert target != "sys.path", f"{path.relative_to(ROOT)}:{node.lineno}: sys.path edit"


def test_the_layout_test_sees_every_room() -> None:
    rooms = {room(module_name(p)) for p in MODULES}
    assert rooms == {"library", "build_steps", "probes"}
    assert any(room(n) == "library" for p in MODULES for n in imports(p) if "probes" in str(p))


def test_every_entry_point_resolves() -> None:
    """[project.scripts]: each ``module:function`` exists, so every venv's bin/ works."""
    with (ROOT / "pyproject.toml").open("rb") as fh:
        scripts = tomllib.load(fh)["project"]["scripts"]
    assert {"check-ep", "check-te", "check-env", "check-fabric"} <= set(scripts)
    for name, target in scripts.items():
        module, _, function = target.partition(":")
        assert callable(getattr(importlib.import_module(module), function, None)), name
