"""The ground floor of check_ep: its name and its options (``Options``).

Why this module exists: the command line, the steps and the checks all speak of these; defined
here, below every other part of check_ep (this module imports none of them, and no torch), they
tie those parts together without an import between them that could run in a circle. What every
probe on a backend shares (``RunOptions``, ``Selection``, ``ProbeKind``) is the rank
machinery's (``_ranks/types.py``); the layer's ``Shape``, ``Dispatched`` and the input classes
are the adapters' interface (``_adapters/base.py``).
"""

from __future__ import annotations

import dataclasses

from ep_image.probes._ranks.types import RunOptions

#: The probe's name in its table, its JSON report and its messages.
PROG = "check_ep"


@dataclasses.dataclass(frozen=True)
class Options(RunOptions):
    """check_ep's command line, checked (``cli.parse_options`` makes it from argparse's
    output, once)."""

    scenarios: tuple[str, ...]  # the selected scenarios' names, in the documented order
    replays: int
    warmup: int
    iters: int
    tolerance: float | None  # None: exact where the inputs allow it, else per dtype
    min_gbs: float
