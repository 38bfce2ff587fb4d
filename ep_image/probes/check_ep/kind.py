"""check_ep as a :class:`ProbeKind`: what its launcher, supervisors, worker and report run.

Why this module exists: the rank machinery (launch, supervisor, worker, output) serves more
than one probe; this is check_ep's entry in it, kept apart so that none of those modules
imports check_ep's own steps (they load ``run_steps`` by name, in the backend process).
"""

from __future__ import annotations

from typing import Any

from ep_image.probes.check_ep import layer, output
from ep_image.probes.check_ep.scenarios.catalogue import SCENARIO_TOKENS, scenario_seed
from ep_image.probes.check_ep.types import CHECK_STEPS, PROG, STEP_NAMES, Options, ProbeKind


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
    step_names=STEP_NAMES,
    run_steps="ep_image.probes.check_ep.steps:run_steps",
    sizes=layer.layer_sizes,
    default_dtype=default_dtype,
    meta=meta,
    header=output.header_lines,
    numbers=output.numbers,
    judged=CHECK_STEPS,
)
