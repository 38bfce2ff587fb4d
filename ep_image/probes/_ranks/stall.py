"""A rank that stopped making progress in a step its peers finished: found in seconds, not after
the whole ``--timeout``.

Why this module exists: a backend that skips a collective on one rank (a cached dispatch that
does not communicate, a memoized result) or hangs there after its last collective leaves the
ranks apart: some reach the end of the step and wait at its agreement, the others wait in the
backend's collective, and nothing moves until the collective timeout (300 s by default). Every
rank posts its arrival at each agreement (``runtime.arrive``: the step, when it began there, when
it ended, its status); each rank's supervisor holds its own backend process's breadcrumb (the
step, the backend call it is in) against its peers' arrivals. A rank still in the step for
``STALL_FACTOR`` times as long as the peers' whole step took, and at least ``STALL_FLOOR``
seconds, after a peer arrived, has stalled.

Peers need not finish the step for it to show: when they skipped a collective and then wait in
another (a barrier of the probe's, the next call's), no rank arrives and each waits in a
different collective. Every rank makes the same backend calls in the same order (``calls.py``),
and each supervisor posts how far its rank got (``call_progress``); a rank still in call #N
``STALL_FLOOR`` seconds (or ``STALL_FACTOR`` times the peers' slowest call of the step) after a
peer returned from call #N without it has stalled too (``stalled_in_call``): a collective call
cannot return on one rank before every rank has joined it.
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


def call_progress(state: dict[str, Any]) -> dict[str, Any]:
    """What a supervisor posts of its rank (its backend process's breadcrumb ``state``) for its
    peers' ``stalled_in_call``: the calls returned and when the last did, the slowest call of
    the step, the call it is in, and wrong data the step found so far."""
    calls = state.get("calls") or {}
    keys = ("returned", "returned_at", "slowest", "step", "call", "number")
    posted = {k: calls.get(k) for k in keys}
    wrong = state.get("wrong") or {}
    if wrong and wrong.get("step") == state.get("current"):
        posted["wrong"] = wrong
    return posted


def in_call_for(state: dict[str, Any], now: float | None = None) -> float:
    """Seconds this rank has been in its current backend call (0 between calls)."""
    since = (state.get("calls") or {}).get("since")
    if not isinstance(since, int | float):
        return 0.0
    return (time.time() if now is None else now) - since


def stalled_in_call(
    state: dict[str, Any], peers: dict[int, dict[str, Any]], rank: int, now: float | None = None
) -> dict[str, Any] | None:
    """Whether this rank (its breadcrumb ``state``) waits in a backend call that peers returned
    from without it (``peers``: rank -> ``call_progress``), past the bound; what to report if
    so: the step and call, the peers that left it and where they are now, the seconds waited
    and the bound, and the wrong data found in the step before it."""
    now = time.time() if now is None else now
    calls = state.get("calls") or {}
    number, since = calls.get("number"), calls.get("since")
    step = state.get("current")
    if not isinstance(number, int) or not isinstance(since, int | float):
        return None
    if step is None or step in UNEVEN_STEPS:
        return None
    left = {
        r: p
        for r, p in peers.items()
        if r != rank and isinstance(p.get("returned"), int) and p["returned"] >= number
    }
    if not left:
        return None
    # When the first peer was past the call, at the latest (it returned from a later one then).
    gone = min(float(p.get("returned_at") or now) for p in left.values())
    slowest = [
        float(p["slowest"])
        for p in left.values()
        if p.get("step") == step and isinstance(p.get("slowest"), int | float)
    ]
    limit = max(STALL_FLOOR, STALL_FACTOR * max(slowest, default=0.0))
    waited = now - max(float(since), gone)
    if waited <= limit:
        return None
    wrong = {str(r): p["wrong"]["detail"] for r, p in sorted(peers.items()) if p.get("wrong")}
    own = state.get("wrong") or {}
    if own.get("step") == step:
        wrong[str(rank)] = own.get("detail")
    return {
        "agreement": int(state.get("agreed", 0)) + 1,
        "step": step,
        "call": calls.get("call"),
        "scenario": state.get("scenario"),
        "left": {
            str(r): {"returned": p["returned"], "call": p.get("call")}
            for r, p in sorted(left.items())
        },
        "finished": {},
        "waited": round(waited, 2),
        "bound": round(limit, 2),
        "peer_call_seconds": round(max(slowest), 3) if slowest else None,
        "wrong_data": bool(wrong),
        "wrong": wrong,
    }
