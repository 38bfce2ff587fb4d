"""check_ep as a :class:`ProbeKind`: what the rank machinery's launcher, supervisors, worker and
report run for it.

Why this module exists: the rank machinery (``_ranks``) serves more than one probe; this is
check_ep's entry in it: its steps (``steps.STEPS``, whose checks import torch only when they
run), its layer's shape, its report's own fields and its table's header.
"""

from __future__ import annotations

from typing import Any

from ep_image.probes._ranks import layer
from ep_image.probes._ranks.types import ProbeKind
from ep_image.probes.check_ep import report
from ep_image.probes.check_ep.options import PROG, Options
from ep_image.probes.check_ep.scenarios.catalogue import SCENARIO_TOKENS, scenario_seed
from ep_image.probes.check_ep.steps import CHECK_STEPS, STEPS, CheckRun


def default_dtype(on_gpu: bool) -> str:
    """``--dtype auto``: bfloat16 for a GPU backend or on a GPU, float32 for the CPU
    reference (exact comparisons at the smallest cost)."""
    return "bfloat16" if on_gpu else "float32"


def meta(options: Options, sizes: dict[str, int]) -> dict[str, Any]:
    """check_ep's own fields of the report: the scenarios selected, their tokens and seeds."""
    return {
        "scenarios": {
            "selected": list(options.scenarios),
            "tokens_per_rank": min(sizes["tokens"], SCENARIO_TOKENS),
            "seeds": {n: scenario_seed(options.seed, n) for n in options.scenarios},
        }
    }


CHECK_EP = ProbeKind(
    prog=PROG,
    front_door="probes/check_ep.py",
    module="ep_image.probes.check_ep",
    steps=STEPS,
    run_type=CheckRun,
    sizes=layer.layer_sizes,
    default_dtype=default_dtype,
    meta=meta,
    header=report.header,
    numbers=report.numbers,
    judged=CHECK_STEPS,
    notes=report.notes,
    unfinished=report.unfinished,
)
