"""check_ep's own parts of its verdict on paper: the scenarios in the table's header, the
report's headline numbers, the preconditions a backend stated, and the scenarios step of a run
that did not finish.

Why this module exists: the rank machinery's report (``_ranks/output.py``) serves every probe;
what only check_ep reports reaches it through check_ep's ``ProbeKind`` (``kind.py``). Nothing
here imports torch: rank 0's supervisor, which never loads it, reports a run that died.
"""

from __future__ import annotations

from typing import Any

from ep_image.probes._ranks.output import header_lines, lean
from ep_image.probes._ranks.runtime import SHARED_GPU_LABEL, RankEnv
from ep_image.probes._ranks.types import Selection, Unfinished
from ep_image.probes._report import Status, Step, one_line
from ep_image.probes.check_ep.scenarios import verdict
from ep_image.probes.check_ep.scenarios.catalogue import BY_NAME, ERROR, FAIL, scenario_seed


def header(sel: Selection, env: RankEnv, meta: dict[str, Any]) -> list[str]:
    """The table's header: every rank probe's, with the scenarios selected."""
    lines = header_lines(sel, env, meta)
    scen = meta.get("scenarios")
    if scen is not None:
        chosen = ", ".join(scen["selected"]) or "none (--scenarios none)"
        lines.append(f"scenarios {chosen} ({scen['tokens_per_rank']} tokens/rank)")
    return lines


def numbers(steps: list[Step]) -> dict[str, Any]:
    """The headline numbers of the run, lifted out of the steps for easy reading."""
    by_name = {s.name: s.data for s in steps}
    out: dict[str, Any] = {}
    dc = by_name.get("dispatch_combine", {})
    for key in (
        "received_per_rank",
        "expected_per_rank",
        "received_per_expert",
        "max_rel_diff",
        "tolerance",
    ):
        if key in dc:
            out[key] = dc[key]
    if "received_per_rank" not in out and "received" in dc:
        out["received_per_rank"] = [dc["received"]]
        out["expected_per_rank"] = [dc["expected"]]
        out["received_per_expert"] = dc["per_expert"]
        out["max_rel_diff"] = dc["rel_diff"]
        out["tolerance"] = dc["tolerance"]
    bw = by_name.get("backward", {})
    if "max_grad_rel_diff" in bw or "grad_rel_diff" in bw:
        out["max_grad_rel_diff"] = bw.get("max_grad_rel_diff", bw.get("grad_rel_diff"))
    rp = by_name.get("replay", {})
    if "rows_per_call_per_rank" in rp or "rows_per_call" in rp:
        out["replay_rows_per_call"] = rp.get("rows_per_call_per_rank", [rp.get("rows_per_call")])
    prec = by_name.get("precision", {})
    if "max_calc_diff" in prec or "calc_diff" in prec:
        out["precision_calc_diff"] = prec.get("max_calc_diff", prec.get("calc_diff"))
        out["precision_weights_calc_diff"] = prec.get(
            "max_weights_calc_diff", prec.get("weights_calc_diff")
        )
    if "accumulation_checked" in prec:
        out["precision_accumulation_checked"] = prec["accumulation_checked"]
    scen = by_name.get("scenarios", {})
    if scen.get("scenarios"):
        out["scenarios"] = {r["name"]: r["status"] for r in scen["scenarios"]}
    band = by_name.get("bandwidth", {})
    keys = ("dispatch_gbs", "combine_gbs", "copy_gbs", "dispatch_vs_copy", "combine_vs_copy")
    split = ("dispatch_nvl_gbs", "dispatch_rdma_gbs", "combine_nvl_gbs", "combine_rdma_gbs")
    for key in (*keys, *split):
        if key in band:
            value = band[key]
            out[key] = value["mean"] if isinstance(value, dict) else value
    if band.get("shared_gpu"):
        out["bandwidth_note"] = SHARED_GPU_LABEL
    slow = band.get("slow_path", {})
    keys = ("dispatch_speedup_vs_reference", "combine_speedup_vs_reference")
    keys += ("dispatch_peak_vs_payload", "combine_peak_vs_payload", "warnings")
    out.update({f"slow_path_{k}": slow[k] for k in keys if k in slow})
    return out


def notes(sel: Selection, steps: list[Step]) -> tuple[dict[str, Any], str]:
    """What the backend refused (a precondition, not a fault), beside the verdict by name: the
    report's ``preconditions``, and the line under the table."""
    preconditions = [
        p for step in steps for p in verdict.preconditions_of(step.data.get("scenarios", []))
    ]
    if not preconditions:
        return {}, ""
    note = "; ".join(f"precondition: {sel.name}'s {verdict.describe(p)}" for p in preconditions)
    return {"preconditions": preconditions}, note


def unfinished(step: Step, end: Unfinished) -> Step:
    """The step a run that did not finish ended in, as check_ep reports it: in the scenarios,
    with those every rank finished and the one that ended it; or, when the backend ended its
    process because it was handed views, the scenarios step with that precondition."""
    if step.name != "scenarios":
        return step
    refusal = verdict.process_end_refusal(end.failure, end.outcomes, end.rank)
    if refusal is not None:
        return _refused_step(end, refusal)
    if not end.failure.get("raised"):
        name = str(end.failure.get("scenario") or "").split(":", 1)[0]
        crashed: dict[str, Any] = {"name": name, "status": ERROR, "detail": step.detail}
        if (end.failure.get("scenario_found") or {}).get("problems"):
            crashed.update(problems=end.failure["scenario_found"]["problems"], wrong_data=True)
        step.data["scenarios"] = [*_finished_scenarios(end.outcomes), crashed]
    if step.status == Status.ERROR and verdict.wrong_data(step.data.get("scenarios", [])):
        step.data["wrong_data"] = True  # the verdict stays "failed" (exit_code_of)
    return step


def _finished_scenarios(outcomes: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """The scenarios every rank finished before its process ended or was stopped, merged
    over the ranks whose breadcrumbs hold them."""
    ranks = [r for r in sorted(outcomes) if outcomes[r].get("scenario_results")]
    lists = [outcomes[r]["scenario_results"] for r in ranks]
    return verdict.merge_results(lists, ranks) if lists else []


def _refused_step(end: Unfinished, refusal: dict[str, Any]) -> Step:
    """The scenarios step when the backend ended a rank's process in ``views`` when handed
    views: the scenarios before keep their verdicts, ``views`` is a precondition (with what it
    found before, wrong numbers included), and the step's status is theirs."""
    options, outcomes, rank, failure = end.options, end.outcomes, end.rank, end.failure
    found = failure.get("scenario_found") or {}
    refusals = [*found.get("preconditions", []), refusal]
    views = {"name": "views", "seed": scenario_seed(options.seed, "views")}
    views.update(input=BY_NAME["views"].exercises)
    views.update(verdict.result_of(list(found.get("problems", [])), refusals))
    views["detail"] += "; the rest of views was not run"
    ended = sorted({rank, *(r for r, o in outcomes.items() if verdict.ended_itself(o))})
    views.update(rank=rank, failed_ranks=ended)
    results = [*_finished_scenarios(outcomes), views]
    meta = end.own.progress.get("meta", {}).get("scenarios", {})
    tokens = int(meta.get("tokens_per_rank", 0))
    failed = any(r["status"] in (FAIL, ERROR) for r in results)
    return Step(
        "scenarios",
        Status.FAIL if failed else Status.PASS,
        seconds=float(failure.get("seconds_in_step", 0.0)),
        detail=one_line(verdict.scenarios_detail(results, tokens)),
        hint=verdict.SCENARIO_HINT if failed else "",
        data={
            "selected": list(meta.get("selected", [])),
            "tokens_per_rank": tokens,
            "seed": options.seed,
            "scenarios": results,
            "refusal": {"rank": rank, **lean({k: v for k, v in failure.items() if k != "raised"})},
        },
    )
