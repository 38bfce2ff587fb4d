"""The front doors: ``probes/<name>.py`` and ``scripts/<name>.py`` each run the command of the same
name in this package (``ep_image.probes.<name>``, ``ep_image.build_steps.<name>``).

Why this module exists: a door is the file a user types (the image's ``probes/check_ep.py``, a
checkout's ``python3 scripts/make_venv.py``); it must run this checkout's package with whatever
python runs it, and every door does that alike. The door puts its checkout first on ``sys.path``
(the package itself never edits it) and hands over here; the name is the whole map from a door
to its command, so a door cannot point at another command than its name says.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import NoReturn

#: Each folder of doors and the package its commands live in.
DOOR_PACKAGES = {"probes": "ep_image.probes", "scripts": "ep_image.build_steps"}


def command_of(door: str | Path) -> str:
    """The module a door runs: ``probes/check_ep.py`` -> ``ep_image.probes.check_ep``."""
    path = Path(door)
    return f"{DOOR_PACKAGES[path.parent.name]}.{path.stem}"


def enter(door: str) -> NoReturn:
    """Run the command of the door at ``door`` (its ``__file__``) and exit with its code."""
    sys.exit(importlib.import_module(command_of(door)).main())
