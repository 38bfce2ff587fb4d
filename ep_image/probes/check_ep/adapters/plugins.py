"""Which adapter class a run drives: the built-in one of each backend's API, or one loaded from
``--backend-class FILE.py:Class`` / ``package.module:Class``.

Why this module exists: the adapters know ``deep_ep`` APIs and the registry knows which backend
ships which (``BackendSpec.api``), so a new backend on a known API needs no code here; and any
:class:`EPBackend` subclass can be checked in their place (the tests inject broken ones).
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from ep_image import backends as registry
from ep_image.cli import UsageError
from ep_image.probes.check_ep.adapters.base import EPBackend
from ep_image.probes.check_ep.adapters.buffer import DeepEPv1Backend
from ep_image.probes.check_ep.adapters.elastic_buffer import DeepEPv2Backend
from ep_image.probes.check_ep.adapters.hybrid_ep_buffer import HybridEPBackend
from ep_image.probes.check_ep.adapters.torch_reference import TorchBackend

#: The adapter of each ``deep_ep`` API (``BackendSpec.api``): the adapters know APIs, the
#: registry knows which backend ships which, so a backend on a known API needs no code here.
ADAPTERS: dict[str, type[EPBackend]] = {
    cls.api: cls for cls in (DeepEPv1Backend, DeepEPv2Backend, HybridEPBackend)
}


def adapter_for(spec: registry.BackendSpec) -> type[EPBackend]:
    """The adapter of ``spec``'s API, as a class named after the backend (for reports)."""
    base = ADAPTERS[spec.api]
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
