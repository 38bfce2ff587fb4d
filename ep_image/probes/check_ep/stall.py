"""A rank that stopped making progress in a step its peers finished: found in seconds, not after
the whole ``--timeout``.

Why this module exists: a backend that skips a collective on one rank (a cached dispatch that
does not communicate, a memoized result) or hangs there after its last collective leaves the
ranks apart: some reach the end of the step and wait at its agreement, the others wait in the
backend's collective, and nothing moves until the collective timeout (300 s by default). Every
rank posts its arrival at each agreement (``ranks.arrive``: the step, when it began there, when
it ended, its status); each rank's supervisor holds its own backend process's breadcrumb (the
step, the backend call it is in) against its peers' arrivals. A rank still in the step for
``STALL_FACTOR`` times as long as the peers' whole step took, and at least ``STALL_FLOOR``
seconds, after a peer arrived, has stalled.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

#: How much longer than its peers' step a rank may take after they finished it.
STALL_FACTOR = 5.0
#: ... and at least this many seconds: ranks of one machine drift this far under load.
STALL_FLOOR = 8.0
#: The import step's trial import runs on one rank per node only (seconds of work the others
#: do not do): a rank that is slower there has not stalled.
UNEVEN_STEPS = ("import",)


def bound(step_seconds: list[float]) -> float:
    """How long a rank may trail its peers' arrival: ``STALL_FACTOR`` times their step's
    median duration, at least ``STALL_FLOOR``."""
    typical = statistics.median(step_seconds) if step_seconds else 0.0
    return max(STALL_FLOOR, STALL_FACTOR * typical)


def stalled(
    state: dict[str, Any], arrivals: dict[int, dict[str, Any]], rank: int, now: float | None = None
) -> dict[str, Any] | None:
    """Whether this rank (its backend process's breadcrumb ``state``) has stalled at the
    agreement its peers' ``arrivals`` (rank -> arrival, for that agreement) reached; what to
    report if so: the agreement, the step and call it is in, the peers that finished and how,
    the seconds waited and the bound."""
    now = time.time() if now is None else now
    peers = {r: a for r, a in arrivals.items() if r != rank}
    if not peers or rank in arrivals:
        return None
    step = state.get("current")
    if step is None or step in UNEVEN_STEPS:
        return None
    durations = [
        a["arrived"] - a["started"]
        for a in peers.values()
        if isinstance(a.get("started"), int | float) and isinstance(a.get("arrived"), int | float)
    ]
    last = max(a.get("arrived", now) for a in peers.values())
    limit = bound(durations)
    waited = now - last
    if waited <= limit:
        return None
    return {
        "agreement": int(state.get("agreed", 0)) + 1,
        "step": step,
        "call": state.get("call"),
        "scenario": state.get("scenario"),
        "finished": {
            str(r): {k: a.get(k) for k in ("status", "step", "detail")}
            for r, a in sorted(peers.items())
        },
        "waited": round(waited, 2),
        "bound": round(limit, 2),
        "peer_step_seconds": round(statistics.median(durations), 3) if durations else None,
        "wrong_data": any(a.get("status") == "fail" for a in peers.values()),
    }
