"""The package's own import graph, read from its source: which ep_image modules each module
imports, and everything a command needs to run.

Why this module exists: two things need the same answer. The layout test holds imports to one
direction and no circle; the Dockerfile's input stages copy exactly what their command imports,
so that an edit elsewhere leaves their (hours-long) layers in the cache and a new import can
never be missing from them (``ep_image.repo.dockerfile`` renders those COPY lines from here).
Standard library only: it runs on the bare base image's Python too.
"""

from __future__ import annotations

import ast
from pathlib import Path

#: The directory holding the package: the repository root, or /opt/ep-image in the image.
ROOT = Path(__file__).resolve().parents[2]


def module_name(path: Path, root: Path = ROOT) -> str:
    """``ep_image/probes/check_ep/cli.py`` -> ``ep_image.probes.check_ep.cli`` (a package's
    ``__init__.py`` is the package)."""
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package under ``root``, by name."""
    return {module_name(p, root): p for p in sorted((root / "ep_image").rglob("*.py"))}


def _is_type_checking(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``): imports only a type checker runs."""
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _nodes(tree: ast.AST, runtime: bool) -> list[ast.AST]:
    """Every node of ``tree``; with ``runtime``, none under an ``if TYPE_CHECKING:``."""
    out, todo = [], [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if runtime and _is_type_checking(node):
            todo += getattr(node, "orelse", [])
            continue
        todo += list(ast.iter_child_nodes(node))
    return out


def imported_modules(
    source: str, known: dict[str, Path], runtime: bool = False
) -> dict[str, set[str]]:
    """The ep_image modules ``source`` imports, each with the names it takes from it: at module
    level, in a ``TYPE_CHECKING`` block (unless ``runtime``: only what running it loads) or
    inside a function alike (a function-level import that only hides a circle is still one).
    Each import is resolved to the module it loads: ``from a.b import c`` is ``a.b.c`` where
    that is a module, else ``a.b``."""
    found: dict[str, set[str]] = {}
    for node in _nodes(ast.parse(source), runtime):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                target, name = (sub, "*") if sub in known else (node.module, alias.name)
                found.setdefault(target, set()).add(name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                found.setdefault(alias.name, set()).add("*")
    return {m: names for m, names in found.items() if m in known}


def needed_by(commands: list[str], root: Path = ROOT) -> set[str]:
    """Every module the ``commands`` (module names) import, directly or not, with themselves and
    every package above each (Python runs a package's ``__init__`` before its modules); a command
    that is a package brings its ``__main__``, which ``python -m`` runs and nothing imports."""
    known = modules(root)
    seen: set[str] = set()
    todo = [*commands, *(f"{c}.__main__" for c in commands)]
    while todo:
        name = todo.pop()
        if name in seen or name not in known:
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        todo += imported_modules(known[name].read_text(), known, runtime=True)
    return seen
