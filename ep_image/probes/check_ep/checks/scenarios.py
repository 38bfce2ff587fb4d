"""The ``scenarios`` step: the selected scenarios, run on every rank, merged into one verdict.

Why this module exists: the scenarios (``scenarios/``) run and check themselves on each rank;
this step turns their results into one line and one JSON entry per scenario, worst rank first,
so a failure names the scenario, the rank and the seed that reproduces it.
"""

from __future__ import annotations

from typing import Any

from ep_image.probes._report import Status, Step, StepFailed, one_line, timed_step
from ep_image.probes.check_ep.adapters.base import EPBackend
from ep_image.probes.check_ep.checks.context import CheckContext
from ep_image.probes.check_ep.ranks import Runtime, agree
from ep_image.probes.check_ep.scenarios import catalogue as scen
from ep_image.probes.check_ep.scenarios import runner
from ep_image.probes.check_ep.types import Options


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
            step.detail = _scenarios_detail(results, tokens)
            if bad:
                raise StepFailed(
                    Status.ERROR if scen.ERROR in statuses else Status.FAIL,
                    step.detail,
                    SCENARIO_HINT,
                    step.data,
                )
    return agree(rt, step, _summarize_scenarios)


SCENARIO_HINT = (
    "the backend is wrong for inputs training presents (docs/probes.md, Scenarios): rerun "
    "one alone with --scenarios NAME and the same --seed to reproduce it, compare with "
    "--backend torch, and report it with this JSON"
)


def _scenarios_detail(results: list[dict[str, Any]], tokens: int) -> str:
    """One line: what failed first (with its rank), what passed, what does not apply."""

    def names(status: str) -> list[str]:
        return [r["name"] for r in results if r["status"] == status]

    parts = []
    for r in results:
        if r["status"] in (scen.FAIL, scen.ERROR):
            where = f" on rank {r['rank']}" if r.get("rank") is not None else ""
            word = "failed" if r["status"] == scen.FAIL else "stopped"
            parts.append(f"{r['name']} {word}{where} (seed {r['seed']}): {r['detail']}")
    passed = names(scen.PASS)
    if passed:
        parts.append(
            f"{len(passed)} passed on every rank: {', '.join(passed)} ({tokens} tokens/rank)"
        )
    parts += [
        r["detail"].replace("not applicable", f"{r['name']} not applicable", 1)
        for r in results
        if r["status"] == scen.NOT_APPLICABLE
    ]
    if names(scen.NOT_RUN):
        parts.append(f"not run: {', '.join(names(scen.NOT_RUN))}")
    return "; ".join(parts)


def _summarize_scenarios(merged: Step, per_rank: list[Step]) -> None:
    """Each scenario merged over ranks: the worst status, the first bad rank's detail."""
    lists = [s.data.get("scenarios") for s in per_rank]
    if not lists or any(not isinstance(x, list) for x in lists) or not lists[0]:
        return
    merged_results = []
    for i, first in enumerate(lists[0]):
        entries = [lst[i] for lst in lists if i < len(lst)]
        worst = max(entries, key=lambda e: scen.SEVERITY.get(e["status"], 0))
        out = {k: v for k, v in first.items() if k not in ("problems",)}
        out["status"] = worst["status"]
        out["detail"] = worst["detail"]
        if worst["status"] in (scen.FAIL, scen.ERROR):
            bad = [r for r, e in enumerate(entries) if e["status"] == worst["status"]]
            out["rank"] = bad[0]
            out["failed_ranks"] = bad
            out["problems"] = worst.get("problems", [])
        if "tokens" in first:
            out["tokens_per_rank"] = [e.get("tokens") for e in entries]
            out["received_per_rank"] = [e.get("received") for e in entries]
            out.pop("tokens", None)
            out.pop("received", None)
        merged_results.append(out)
    merged.data["scenarios"] = merged_results
    tokens = per_rank[0].data.get("tokens_per_rank", 0)
    merged.detail = one_line(_scenarios_detail(merged_results, tokens))
