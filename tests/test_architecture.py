"""The package's layout holds: imports go one way, nothing edits sys.path, entry points resolve.

docs/architecture.md draws the parts; these tests keep the drawing true.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from ep_image.repo import import_graph

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ep_image"


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
MODULE_NAMES = import_graph.modules(ROOT)


def module_name(path: Path) -> str:
    return import_graph.module_name(path, ROOT)


def imported_modules(source: str) -> dict[str, set[str]]:
    return import_graph.imported_modules(source, MODULE_NAMES)


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph`` (module -> modules it imports): each strongly connected
    set of two or more modules, or a module that imports itself (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                members.append(member)
                if member == node:
                    break
            if len(members) > 1 or node in graph.get(node, ()):
                circles.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


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


def test_no_import_circle_among_ep_image_modules() -> None:
    """Imports among ep_image's modules form no circle: each part stands above what it imports
    (the rank machinery's shared types on its ground floor, ``_ranks/types.py``), so the order in
    which modules load never decides whether a name exists yet."""
    imports_of = {name: imported_modules(path.read_text()) for name, path in MODULE_NAMES.items()}
    graph = {name: set(targets) for name, targets in imports_of.items()}
    found = []
    for circle in import_circles(graph):
        ties = [
            f"{a} -> {b}: {', '.join(sorted(imports_of[a][b]))}"
            for a in circle
            for b in circle
            if b in imports_of[a]
        ]
        found.append("circle of " + ", ".join(circle) + "\n    " + "\n    ".join(ties))
    assert not found, "\n".join(found)


def probe_of(module: str) -> str | None:
    """The probe a module of ``ep_image.probes`` belongs to (``check_ep``, ``upstream_test``),
    or None for the code the probes share (``_ranks``, ``_adapters``, ``_report``, ...)."""
    parts = module.split(".")
    if len(parts) < 3 or parts[:2] != ["ep_image", "probes"] or parts[2].startswith("_"):
        return None
    return parts[2]


PROBE_MODULES = [p for p in MODULES if room(module_name(p)) == "probes"]


@pytest.mark.parametrize("path", PROBE_MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_rank_probes_meet_only_in_shared_code(path: Path) -> None:
    """check_ep and check_train run on the rank machinery (``_ranks``) and the backends'
    adapters (``_adapters``) as equals: neither imports the other, and the code the probes
    share (a module or package with a leading underscore) imports no probe."""
    own = probe_of(module_name(path))
    probes = {probe_of(name) for name in imports(path)} - {None, own}
    if own is None:
        assert not probes, f"{path.relative_to(ROOT)} (shared) imports the probes {probes}"
    elif own in ("check_ep", "check_train"):
        other = ({"check_ep", "check_train"} - {own}).pop()
        assert other not in probes, f"{path.relative_to(ROOT)} ({own}) imports {other}"


def test_a_command_that_is_a_package_needs_its_main() -> None:
    """``python -m`` on a package runs its ``__main__``, which no module imports: the import
    graph counts it with the command, so the Dockerfile's input stages copy it."""
    needed = import_graph.needed_by(["ep_image.build_steps.dedup"], ROOT)
    assert {
        "ep_image.build_steps",
        "ep_image.build_steps.dedup",
        "ep_image.build_steps.dedup.__main__",
        "ep_image.build_steps.dedup.tree",
    } <= needed


def test_the_circle_test_sees_function_level_imports_and_circles(tmp_path: Path) -> None:
    """Guards the two halves of the test above on a made-up graph and source."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "from ep_image.probes import _report\n"
        "if TYPE_CHECKING:\n    from ep_image.probes._adapters.base import Shape\n"
        "def f():\n    from ep_image.probes._ranks.steps import run_steps\n"
        "    import ep_image.cli\n"
    )
    assert imported_modules(source) == {
        "ep_image.probes._report": {"*"},
        "ep_image.probes._adapters.base": {"Shape"},
        "ep_image.probes._ranks.steps": {"run_steps"},
        "ep_image.cli": {"*"},
    }
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}, "f": {"a"}}
    assert import_circles(graph) == [["a", "b", "c"], ["e"]]


@pytest.mark.parametrize("probe", ["check_ep", "check_train"])
def test_importing_a_rank_probe_loads_no_torch(probe: str) -> None:
    """The check-ep and check-train entry points import their package: each must answer --help,
    bad usage and a missing backend without loading torch (the worker imports torch, and what
    needs it)."""
    code = (
        f"import sys, ep_image.probes.{probe} as probe\n"
        "assert callable(probe.main)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]", out.stdout


#: The modules at the package's root: its face (SOURCE_ROOT, child_env), the command-line
#: scaffold every command runs on, the pins. Anything else belongs to a package of its subject.
ROOT_MODULES = {"__init__.py", "cli.py", "pins.py"}


def test_the_package_root_holds_no_loose_modules() -> None:
    """A module at ep_image's root is found by nobody looking for its subject: it goes into the
    package of its subject (native/, files/, repo/, ...) or beside the only part that uses it
    (build_steps/_*, probes/_*)."""
    loose = {p.name for p in PACKAGE.glob("*.py")} - ROOT_MODULES
    assert not loose, f"modules loose at ep_image's root: {sorted(loose)} (docs/architecture.md)"


def test_the_layout_test_sees_every_room() -> None:
    rooms = {room(module_name(p)) for p in MODULES}
    assert rooms == {"library", "build_steps", "probes"}
    assert any(room(n) == "library" for p in MODULES for n in imports(p) if "probes" in str(p))


def test_every_entry_point_resolves() -> None:
    """[project.scripts]: each ``module:function`` exists, so every venv's bin/ works."""
    with (ROOT / "pyproject.toml").open("rb") as fh:
        scripts = tomllib.load(fh)["project"]["scripts"]
    assert {"check-ep", "check-train", "check-te", "check-env", "check-fabric"} <= set(scripts)
    for name, target in scripts.items():
        module, _, function = target.partition(":")
        assert callable(getattr(importlib.import_module(module), function, None)), name
