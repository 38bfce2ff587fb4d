"""check_ep's scenarios: the routing training produces, not only one uniform layout, and the
ways training frameworks drive a backend.

The table of scenarios (changing, skewed, dropped, uneven, reuse; interleaved, recompute,
lifecycle, marks, views), their seeds and token counts; it imports without torch so the
command line can name them before torch loads. ``routing`` makes their routings and ``runner``
runs them. See docs/probes.md, section "Scenarios".
"""

from __future__ import annotations

import dataclasses
import zlib

from ep_image.probes._adapters.base import DROPPED_SLOTS, UNEVEN_TOKENS, EPBackend

#: Tokens per rank in a scenario: the layer's, up to this many (a multiple of 64, HybridEP's
#: chunk size).
SCENARIO_TOKENS = 512

PASS, FAIL, ERROR = "pass", "fail", "error"
NOT_APPLICABLE, NOT_RUN = "not applicable", "not run"
#: The backend refused an input frameworks may pass but need not (``views``: a non-contiguous
#: tensor), by raising or by ending its process: a precondition, reported by name, that leaves
#: the verdict to what it did with the inputs it took.
REFUSED = "refused"
#: How bad a scenario's status is, for merging ranks (higher wins): a refusal on any rank is
#: shown over a pass, and it never makes the step fail.
SEVERITY = {NOT_RUN: 0, NOT_APPLICABLE: 0, PASS: 0, REFUSED: 1, FAIL: 2, ERROR: 3}


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One class of input training presents."""

    name: str
    exercises: str
    layouts: int = 1
    rounds: int = 0  # extra rounds of new activations through each layout
    needs: tuple[str, ...] = ()  # types.INPUT_CLASSES it needs the backend to take
    routing: str = "uniform"  # uniform | skewed | dropped | marks
    uneven: bool = False
    #: How a framework drives the layouts (runner.py): its inputs as views of wider tensors
    #: that it overwrites after each call, and the outputs it got back written over too
    #: (``views``); every layout dispatched before any is combined (``interleaved``); each
    #: routing dispatched again after the later ones, as activation checkpointing's
    #: recompute does, before its backward (``recompute``); the buffer destroyed and made
    #: again between two layouts (``lifecycle``).
    views: bool = False
    interleaved: bool = False
    recompute: bool = False
    lifecycle: bool = False
    tokens: int | None = None  # tokens per rank, when fewer than the other scenarios'


SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "changing",
        "routing that changes on every call: 4 layouts forward, then each one's backward in "
        "reverse order",
        layouts=4,
    ),
    Scenario(
        "skewed",
        "imbalanced routing: one expert gets every token, a few most, several experts and the "
        "last rank none",
        routing="skewed",
    ),
    Scenario(
        "dropped",
        "top-k slots with index -1: a quarter of the slots, every eighth token routed nowhere",
        routing="dropped",
        needs=(DROPPED_SLOTS,),
    ),
    Scenario(
        "uneven",
        "ranks holding different numbers of tokens, one of them 0",
        uneven=True,
        needs=(UNEVEN_TOKENS,),
    ),
    Scenario(
        "reuse",
        "new activations through an existing layout: 2 rounds of cached dispatch and combine "
        "on one handle",
        rounds=2,
    ),
    Scenario(
        "interleaved",
        "several live layouts: 2 routings dispatched before either is combined, combined in "
        "the other order, then each one's backward",
        layouts=2,
        interleaved=True,
        tokens=64,
    ),
    Scenario(
        "recompute",
        "activation checkpointing's order: 2 layouts forward, then from the last to the first "
        "each routing dispatched again after the later one went through the buffer, its rows "
        "held against its forward's, then its backward",
        layouts=2,
        recompute=True,
        tokens=64,
    ),
    Scenario(
        "lifecycle",
        "the buffer's whole life: used, destroyed, made again on the same group, used again",
        layouts=2,
        lifecycle=True,
        tokens=64,
    ),
    Scenario(
        "marks",
        "every way a router marks a slot: -1 in a token's first, last or every slot, and valid "
        "experts with weight 0 (delivered and counted, contributing nothing)",
        routing="marks",
        needs=(DROPPED_SLOTS,),
        tokens=64,
    ),
    # Last: a backend that refuses views by ending its process (an abort in its native code)
    # takes no other scenario with it.
    Scenario(
        "views",
        "inputs as views of wider tensors (a column slice, a transpose) that the caller "
        "overwrites after each call, and the outputs it got back written over too",
        rounds=1,
        views=True,
        tokens=64,
    ),
)
BY_NAME = {s.name: s for s in SCENARIOS}
NAMES = tuple(BY_NAME)


def parse(spec: str) -> list[str]:
    """``--scenarios``: ``all``, ``none`` or a comma list of names (ValueError names the rest)."""
    text = spec.strip()
    if text == "all":
        return list(NAMES)
    if text in ("none", ""):
        return []
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise ValueError(
            f"unknown scenario {', '.join(repr(n) for n in unknown)}; choose from "
            f"{', '.join(NAMES)}, or all or none"
        )
    return [n for n in NAMES if n in names]  # run in the documented order, once each


def scenario_seed(base: int, name: str) -> int:
    """The seed of one scenario: from --seed and its name, the same on every machine."""
    return (base * 1_000_003 + zlib.crc32(name.encode())) % (1 << 62)


def scenario_tokens(tokens: int) -> int:
    """Tokens per rank in a scenario, from the layer's."""
    return min(tokens, SCENARIO_TOKENS)


def not_applicable(backend: EPBackend, scenario: Scenario) -> str | None:
    """Why ``backend``'s documented API does not take this scenario's input (None: it does)."""
    for need in scenario.needs:
        reason = backend.input_limits.get(need)
        if reason:
            return f"not applicable to {backend.name}: {reason}"
    return None


def tokens_of(scenario: Scenario, base: int, rank: int, world: int) -> int:
    """Tokens ``rank`` holds: ``base`` (at most the scenario's own count), or for ``uneven`` a
    pattern with a 0 in it."""
    if scenario.tokens is not None:
        base = min(base, scenario.tokens)
    if not scenario.uneven:
        return base
    if world == 1:
        return 0
    pattern = (max(base - 5, 1), 0, base, base // 2 + 1)
    return pattern[rank % len(pattern)]
