"""The ``scenarios`` step: the selected scenarios, run on every rank, merged into one verdict.

Why this module exists: the scenarios (``scenarios/``) run and check themselves on each rank;
this step turns their results into one line and one JSON entry per scenario, worst rank first,
so a failure names the scenario, the rank and the seed that reproduces it.
"""

from __future__ import annotations

from ep_image.probes._adapters.base import EPBackend
from ep_image.probes._ranks.runtime import Runtime, agree
from ep_image.probes._report import Status, Step, StepFailed, one_line, timed_step
from ep_image.probes.check_ep.checks.context import CheckContext
from ep_image.probes.check_ep.options import Options
from ep_image.probes.check_ep.scenarios import catalogue as scen
from ep_image.probes.check_ep.scenarios import runner, verdict


def step_scenarios(rt: Runtime, backend: EPBackend, ctx: CheckContext, options: Options) -> Step:
    """The selected scenarios (``scenarios.catalogue``), each checked on every rank."""
    with timed_step("scenarios") as step:
        names = list(options.scenarios)
        tokens = scen.scenario_tokens(ctx.shape.tokens)
        step.data = {
            "selected": names,
            "tokens_per_rank": tokens,
            "tolerance": ctx.tolerance,
            "seed": options.seed,
            "scenarios": [],
        }
        if not names:
            step.status = Status.INFO
            step.detail = "no scenario selected (--scenarios none)"
        else:
            results = runner.run_all(rt, backend, ctx.shape, names, options.seed, ctx.tolerance)
            step.data["scenarios"] = results
            statuses = {r["status"] for r in results}
            bad = [r for r in results if r["status"] in (scen.FAIL, scen.ERROR)]
            step.detail = verdict.scenarios_detail(results, tokens)
            if bad:
                raise StepFailed(
                    Status.ERROR if scen.ERROR in statuses else Status.FAIL,
                    step.detail,
                    verdict.SCENARIO_HINT,
                    step.data,
                )
    return agree(rt, step, _summarize_scenarios)


def _summarize_scenarios(merged: Step, per_rank: list[Step]) -> None:
    """Each scenario merged over ranks: the worst status, the first bad rank's detail; a step
    that stopped after a scenario returned wrong numbers says so (``wrong_data``: the verdict
    stays "failed")."""
    lists = [s.data.get("scenarios") for s in per_rank]
    if not lists or any(not isinstance(x, list) for x in lists) or not lists[0]:
        return
    merged_results = verdict.merge_results(lists)
    merged.data["scenarios"] = merged_results
    merged.data.pop("wrong_data", None)
    if merged.status == Status.ERROR and verdict.wrong_data(merged_results):
        merged.data["wrong_data"] = True
    tokens = per_rank[0].data.get("tokens_per_rank", 0)
    merged.detail = one_line(verdict.scenarios_detail(merged_results, tokens))
