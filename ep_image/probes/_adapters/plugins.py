"""Which adapter class a run drives: the built-in one of each backend's API, or one loaded from
``--backend-class FILE.py:Class`` / ``package.module:Class``.

Why this module exists: the adapters know APIs (a module and its class: ``deep_ep.Buffer``,
``nccl.ep.Group``) and the registry knows which backend ships which (``BackendSpec.module`` and
``.api``), so a new backend on a known API needs no code here, and a new API only its adapter
module beside the others (found here by its ``module`` and ``api``); and any :class:`EPBackend`
subclass can be checked in their place (the tests inject broken ones).
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import sys
from pathlib import Path

from ep_image import backends as registry
from ep_image.cli import UsageError
from ep_image.probes import _adapters
from ep_image.probes._adapters.base import EPBackend
from ep_image.probes._adapters.torch_reference import TorchBackend


def _adapters_by_api() -> dict[tuple[str, str], type[EPBackend]]:
    """Every adapter module's class that names an API, by (module, class) it drives: the
    adapters know APIs, the registry knows which backend ships which."""
    found: dict[tuple[str, str], type[EPBackend]] = {}
    for info in sorted(pkgutil.iter_modules(_adapters.__path__), key=lambda m: m.name):
        if info.name == "plugins":
            continue
        module = importlib.import_module(f"{_adapters.__name__}.{info.name}")
        for value in vars(module).values():
            is_adapter = isinstance(value, type) and issubclass(value, EPBackend)
            if is_adapter and value.api and value.__module__ == module.__name__:
                found[(value.module, value.api)] = value
    return found


#: The adapter of each API (``BackendSpec.module`` and ``.api``).
ADAPTERS: dict[tuple[str, str], type[EPBackend]] = _adapters_by_api()


def adapter_for(spec: registry.BackendSpec) -> type[EPBackend]:
    """The adapter of ``spec``'s API, as a class named after the backend (for reports)."""
    base = ADAPTERS.get((spec.module, spec.api))
    if base is None:
        raise RuntimeError(
            f"no adapter drives {spec.module}.{spec.api} (backend {spec.name}): add one under "
            "ep_image/probes/_adapters/ with module and api set"
        )
    return type(base.__name__, (base,), {"name": spec.name, "__module__": base.__module__})


BUILTIN: dict[str, type[EPBackend]] = {s.name: adapter_for(s) for s in registry.SPECS}
BUILTIN["torch"] = TorchBackend


def load_backend_class(spec: str) -> type[EPBackend]:
    """Load ``FILE.py:Class`` or ``package.module:Class``; it must subclass EPBackend."""
    target, sep, class_name = spec.rpartition(":")
    if not sep or not target or not class_name:
        raise UsageError(f"--backend-class {spec!r}: expected FILE.py:Class or module:Class")
    if target.endswith(".py") or "/" in target:
        path = Path(target)
        if not path.is_file():
            raise UsageError(f"--backend-class: file not found: {target}")
        module_name = f"_ep_backend_{abs(hash(str(path.resolve())))}"
        spec_obj = importlib.util.spec_from_file_location(module_name, path)
        if spec_obj is None or spec_obj.loader is None:
            raise UsageError(f"--backend-class: cannot load {target} as Python")
        module = importlib.util.module_from_spec(spec_obj)
        # Registered first, as an import registers a module: what the file defines may look
        # itself up there while it runs (a @dataclass does).
        sys.modules[module_name] = module
        spec_obj.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise UsageError(f"--backend-class: cannot import module {target!r}: {exc}") from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise UsageError(f"--backend-class: {target} has no attribute {class_name!r}")
    if not (isinstance(cls, type) and issubclass(cls, EPBackend)):
        raise UsageError(
            f"--backend-class: {class_name} is not a subclass of {EPBackend.__module__}.EPBackend"
        )
    return cls
