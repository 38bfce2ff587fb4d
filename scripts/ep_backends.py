#!/usr/bin/env python3
"""Command-line view of the EP backend registry, which lives in ep_image/backends.py.

Why this file still exists: it is the path the GPU workflow calls (``ep_backends.py --names``
expands ``all``) and the module scripts/check_installed.py imports as a sibling. It holds no
backend knowledge of its own: it re-exports the registry and runs its CLI, so there is still one
place where a backend is defined.

    python scripts/ep_backends.py [--json | --names | --image-ep | --default] [--project DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

# The repository root (or /opt/ep-image in the image), where the ep_image package sits.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ep_image.backends import (
    ALL,
    BACKEND_NAMES,
    DEFAULT_BACKEND,
    DEFAULT_PROJECT,
    MODULE,
    Backend,
    RegistryError,
    UnknownBackendError,
    expand_backends,
    get_backend,
    known_distributions,
    load_registry,
    main,
    normalize,
    other_distributions,
    valid_names_text,
    validate_backend,
)

__all__ = [
    "ALL",
    "BACKEND_NAMES",
    "DEFAULT_BACKEND",
    "DEFAULT_PROJECT",
    "MODULE",
    "Backend",
    "RegistryError",
    "UnknownBackendError",
    "expand_backends",
    "get_backend",
    "known_distributions",
    "load_registry",
    "main",
    "normalize",
    "other_distributions",
    "valid_names_text",
    "validate_backend",
]

if __name__ == "__main__":
    sys.exit(main())
