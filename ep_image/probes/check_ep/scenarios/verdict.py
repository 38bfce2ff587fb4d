"""The scenarios' results merged over ranks, and the preconditions a backend states, without torch.

Why this module exists: the ``scenarios`` step merges each rank's results in the backend
process, and rank 0's supervisor (which never imports torch) merges them again from the
breadcrumbs when a rank's process ended in the middle of ``views``; both must read the same
statuses the same way. A backend that refuses a non-contiguous tensor (it raises, or ends its
process with an abort) has stated a precondition, not returned wrong numbers: it is named here,
beside the verdict on what it did with the inputs it took. See docs/probes.md, "Scenarios".
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ep_image.probes.check_ep.scenarios.catalogue import (
    ERROR,
    FAIL,
    NOT_APPLICABLE,
    NOT_RUN,
    PASS,
    REFUSED,
    SEVERITY,
)

#: The views a caller hands over (``caller.as_view``): a column slice of a wider tensor, and the
#: transpose of a transposed copy.
VIEW_KINDS = ("column slice", "transpose")

#: Signals that mean a backend ended its own process on purpose (an assertion in native code
#: calls abort()); any other signal (SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGKILL) is a fault.
REFUSING_SIGNALS = ("SIGABRT",)


@dataclasses.dataclass
class Refusal:
    """A precondition: ``call`` would not take views of ``tensors`` ("x (transpose)"), and
    ``how`` it said so. ``alone``: each tensor was refused handed alone as a view (narrowed
    down); else these are the views handed together in the call that ended the process."""

    scenario: str
    call: str
    tensors: list[str]
    how: str
    alone: bool = True

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def label(tensor: str, kind: str) -> str:
    """How a tensor handed as a view is named: ``x (column slice)``."""
    return f"{tensor} ({kind})"


def _grouped(tensors: list[str]) -> str:
    """``x (column slice), x (transpose)`` as ``x (column slice, transpose)``."""
    kinds: dict[str, list[str]] = {}
    for text in tensors:
        name, _, kind = text.partition(" (")
        kinds.setdefault(name, []).append(kind.rstrip(")"))
    return ", ".join(f"{n} ({', '.join(k)})" if k != [""] else n for n, k in kinds.items())


SCENARIO_HINT = (
    "the backend is wrong for inputs training presents (docs/probes.md, Scenarios): rerun "
    "one alone with --scenarios NAME and the same --seed to reproduce it, compare with "
    "--backend torch, and report it with this JSON"
)


def describe(pre: dict[str, Any]) -> str:
    """One precondition in words: ``dispatch refuses views of x (column slice, transpose):
    raises RuntimeError: ...``."""
    if pre.get("alone", True):
        return f"{pre['call']} refuses views of {_grouped(pre['tensors'])}: {pre['how']}"
    return f"{pre['call']} {pre['how']} when handed views of {_grouped(pre['tensors'])}"


def preconditions_of(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every precondition the scenarios' results name, in order."""
    return [p for r in results for p in r.get("preconditions", [])]


def wrong_data(results: list[dict[str, Any]]) -> bool:
    """Whether the backend returned wrong numbers in a scenario (before whatever stopped it)."""
    return any(r["status"] == FAIL or r.get("wrong_data") for r in results)


def scenarios_detail(results: list[dict[str, Any]], tokens: int) -> str:
    """One line: what failed first (with its rank), what passed, what was refused, what does
    not apply."""

    def names(status: str) -> list[str]:
        return [r["name"] for r in results if r["status"] == status]

    parts = []
    for r in results:
        if r["status"] in (FAIL, ERROR):
            where = f" on rank {r['rank']}" if r.get("rank") is not None else ""
            word = "failed" if r["status"] == FAIL else "stopped"
            parts.append(f"{r['name']} {word}{where} (seed {r['seed']}): {r['detail']}")
    passed = names(PASS)
    if passed:
        parts.append(
            f"{len(passed)} passed on every rank: {', '.join(passed)} ({tokens} tokens/rank)"
        )
    parts += [f"{r['name']} {r['detail']}" for r in results if r["status"] == REFUSED]
    parts += [
        r["detail"].replace("not applicable", f"{r['name']} not applicable", 1)
        for r in results
        if r["status"] == NOT_APPLICABLE
    ]
    if names(NOT_RUN):
        parts.append(f"not run: {', '.join(names(NOT_RUN))}")
    return "; ".join(parts)


def merge_results(
    lists: list[list[dict[str, Any]]], ranks: list[int] | None = None
) -> list[dict[str, Any]]:
    """Each scenario merged over ranks (``lists``: one list per rank of ``ranks``, every rank
    in order by default): the worst status, the first such rank's detail, problems and
    preconditions; token counts per rank."""
    ranks = list(range(len(lists))) if ranks is None else ranks
    merged = []
    for i, first in enumerate(max(lists, key=len)):
        held = [(r, lst[i]) for r, lst in zip(ranks, lists, strict=True) if i < len(lst)]
        entries = [e for _, e in held]
        worst = max(entries, key=lambda e: SEVERITY.get(e["status"], 0))
        out = {k: v for k, v in first.items() if k not in ("problems", "preconditions")}
        out["status"] = worst["status"]
        out["detail"] = worst["detail"]
        if worst["status"] in (FAIL, ERROR, REFUSED):
            bad = [r for r, e in held if e["status"] == worst["status"]]
            out["rank"] = bad[0]
            out["failed_ranks"] = bad
        if worst.get("problems"):
            out["problems"] = worst["problems"]
        if any(e.get("wrong_data") for e in entries):
            out["wrong_data"] = True
        pre = worst.get("preconditions") or next(
            (e["preconditions"] for e in entries if e.get("preconditions")), None
        )
        if pre:
            out["preconditions"] = pre
        if "tokens" in first:
            out["tokens_per_rank"] = [e.get("tokens") for e in entries]
            out["received_per_rank"] = [e.get("received") for e in entries]
            out.pop("tokens", None)
            out.pop("received", None)
        merged.append(out)
    return merged


def result_of(problems: list[str], refusals: list[dict[str, Any]]) -> dict[str, Any]:
    """A scenario's status and detail from what it found: wrong numbers fail it (the
    refusals are still named), refusals alone leave it ``refused``, nothing at all passes."""
    entry: dict[str, Any] = {"status": PASS, "detail": ""}
    if refusals:
        entry["preconditions"] = refusals
    if problems:
        more = len(problems) - 1
        entry["status"] = FAIL
        entry["detail"] = problems[0] + (f" (and {more} more problems)" if more else "")
        entry["problems"] = problems[:8]
    elif refusals:
        entry["status"] = REFUSED
        entry["detail"] = "refused: " + "; ".join(describe(p) for p in refusals)
        if all(p.get("alone", True) for p in refusals):
            entry["detail"] += "; the views it takes were checked"
    return entry


def process_end_refusal(
    failure: dict[str, Any], outcomes: dict[int, dict[str, Any]], rank: int
) -> dict[str, Any] | None:
    """The precondition a rank's process ending states, or None when that end is a fault.

    It is one when the backend ended the process itself (an abort, an exit with any status)
    inside a call of ``views`` that was handed views (the breadcrumb ``scenario_views``), and no
    rank's process ended any other way than that or being stopped after it: a memory fault, a
    hang or an error stays a fault wherever it happens.
    """
    views = failure.get("scenario_views") or {}
    call = str(failure.get("call") or "").split(",", 1)[0]
    scenario = str(failure.get("scenario") or "").split(":", 1)[0]
    if scenario != "views" or not views.get("tensors") or call != views.get("call"):
        return None
    for outcome in outcomes.values():
        if outcome["how"] not in ("stopped", "finished") and not ended_itself(outcome):
            return None
    if not ended_itself(failure):
        return None
    if failure["how"] == "signal":
        how = f"ended its process with {failure['signal']}"
    else:
        how = f"ended its process with status {failure.get('exit_status')}"
    if len(outcomes) > 1:
        ended = sorted({rank, *(r for r, o in outcomes.items() if ended_itself(o))})
        how += f" on rank {ended[0]}" if len(ended) == 1 else f" on ranks {ended}"
    return Refusal("views", call, list(views["tensors"]), how, alone=False).to_json()


def ended_itself(outcome: dict[str, Any]) -> bool:
    """Whether a rank's backend process ended itself on purpose: an abort, or an exit."""
    return outcome["how"] == "exit" or (
        outcome["how"] == "signal" and outcome.get("signal") in REFUSING_SIGNALS
    )
