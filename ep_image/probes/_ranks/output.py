"""A rank probe's verdict on paper: the table, the JSON report, and the report of a run that
died.

Why this module exists: rank 0 speaks for the job. When every rank finishes, rank 0's
backend process prints the table and writes the JSON. When one does not (a crash, an exit
without a verdict, a hang, a launcher tearing the job down), rank 0's supervisor writes the
same table and JSON from the breadcrumbs and the job's board, naming the rank and the step
where it happened, so no failure ends without a report. What only one probe reports (check_ep's
scenarios and preconditions) comes from its ``ProbeKind`` (``notes``, ``unfinished``).
"""

from __future__ import annotations

import sys
from typing import Any

from ep_image.probes import _installed, _supervise, _venv_record
from ep_image.probes._ranks import import_failure
from ep_image.probes._ranks.runtime import SHARED_GPU_LABEL, RankEnv
from ep_image.probes._ranks.types import ProbeKind, RunOptions, Selection, Unfinished, not_run
from ep_image.probes._report import (
    Status,
    Step,
    build_report,
    exit_code_of,
    one_line,
    render_table,
    write_report,
)
from ep_image.probes._supervise import Outcome


def header_lines(sel: Selection, env: RankEnv, meta: dict[str, Any]) -> list[str]:
    """The table's header every rank probe begins with: the backend, where it ran, the shape."""
    lines = [f"backend {sel.name} ({sel.how})"]
    where = f"world {env.world}"
    if env.nodes > 1:
        where += f" = {env.nodes} nodes x {env.local_world} ranks"
    if meta.get("device"):
        where += f", device {meta['device']}, dtype {meta.get('dtype')}"
    if meta.get("shared_gpu"):
        where += f" ({meta.get('ranks_per_gpu')} ranks/GPU: {SHARED_GPU_LABEL})"
    lines.append(where)
    if meta.get("shape"):
        s = meta["shape"]
        lines.append(
            f"tokens/rank {s['tokens']}, hidden {s['hidden']}, experts {s['experts']} "
            f"({s['experts'] // env.world}/rank), top-{s['topk']}, seed {meta.get('seed')}"
        )
    return lines


def finish(
    kind: ProbeKind,
    options: RunOptions,
    env: RankEnv,
    sel: Selection,
    steps: list[Step],
    meta: dict[str, Any],
    code: int,
    **extra: Any,
) -> int:
    """Print the table and write the JSON report on rank 0; return ``code``."""
    if env.rank != 0 or _supervise.progress.stopping:
        return code
    versions = {
        "python": sys.version.split()[0],
        "torch": (_installed.dist_version("torch") or (None, None))[1],
    }
    if sel.installed is not None:
        versions["backend"] = sel.installed.to_json()
    # Which venv rank 0 ran in and what it took from outside it (every rank runs the same
    # interpreter and imports; rank 0 is the one that writes the report).
    extra.setdefault("environment", _venv_record.environment_facts())
    fields, note = kind.notes(sel, steps) if kind.notes is not None else ({}, "")
    for key, value in fields.items():
        extra.setdefault(key, value)
    report = build_report(
        kind.prog,
        steps,
        code,
        backend=sel.name,
        backend_selection=sel.how,
        world_size=env.world,
        nodes=env.nodes,
        require=bool(options.require),
        versions=versions,
        numbers=kind.numbers(steps),
        **meta,
        **extra,
    )
    table = render_table(kind.prog, kind.header(sel, env, meta), steps, code, one_line(note))
    print(table, flush=True)
    if options.json:
        write_report(options.json, report)
    return code


# ------------------------------------------------------------------------------------------
# A run that did not finish
# ------------------------------------------------------------------------------------------

_HINTS = {
    "signal": "the backend crashed in native code (Python stack above): run its own tests on "
    "this machine, check that it was built for this torch, CUDA and NCCL, and report it "
    "with this JSON",
    "exit": "the backend ended its process (os._exit or sys.exit) instead of raising: no "
    "verdict came from that rank; report it with this JSON",
    "hang": "the step never returned (stacks above: the supervisor dumped them before "
    "stopping it): a kernel waiting for a peer that never arrived, or a CPU wait on the GPU; "
    "run the backend's own tests here and check --timeout",
    "error": "the probe lost a collective (a peer that died or hung is the usual cause): "
    "read every rank's log; if no rank failed, report it with this JSON",
    "import_error": "the probe's own imports failed in this python: run it with the python of "
    "an environment that holds the project (a scripts/make_venv.py venv's bin/python, the "
    "image's python, or uv run after uv sync --extra <backend>)",
    "raised": "the backend raised on some ranks only, while the others waited in its collective: "
    "the error above is the first; run the backend's own tests here and report it with this "
    "JSON",
    "stopped": "the launcher stopped the job before any rank posted a failure (SIGTERM); "
    "look at the launcher's log for the first rank that exited",
    "stall": "the stalled rank waits in a collective its peers never joined (a backend that "
    "answered from a cache or skipped its communication on their side), or hangs in native code "
    "after its last collective (its stack is above): run the backend's own tests here and "
    "report it with this JSON",
}


def _describe(rank: int, world: int, outcome: dict[str, Any], deadline: float) -> str:
    who = f"rank {rank}" if world > 1 or outcome["how"] == "signal" else "the backend process"
    step = outcome.get("step") or "import"
    if outcome.get("scenario"):
        step += f" (scenario {outcome['scenario']})"
    where = f" at {outcome['where']}" if outcome.get("where") else ""
    if outcome["how"] == "signal":
        return f"{who} died with {outcome['signal']} during {step}{where}"
    if outcome["how"] == "exit":
        return (
            f"{who} exited with status {outcome.get('exit_status')} during {step} without a "
            f"verdict{where}"
        )
    if outcome["how"] == "hang":
        return f"{step} did not finish within {deadline:g} s on {who}{where}"
    if outcome["how"] == "error":
        return f"{who} failed during {step}: {outcome.get('error')}"
    if outcome["how"] == "stall":
        found = outcome.get("stall") or {}
        call = f" (in the backend's {found['call']})" if found.get("call") else ""
        scenario = f" (scenario {found['scenario']})" if found.get("scenario") else ""
        finished = found.get("finished", {})
        if found.get("left"):
            return _describe_call_stall(rank, found, f"{found.get('step', step)}{call}{scenario}")
        text = (
            f"rank {rank} stopped making progress in {found.get('step', step)}{call}{scenario} "
            f"after ranks {[int(r) for r in finished]} finished that step: no progress for "
            f"{found.get('waited')} s after them, past the bound of {found.get('bound')} s"
        )
        if found.get("peer_step_seconds") is not None:
            text += f" (their step took {found['peer_step_seconds']} s)"
        wrong = [
            f"rank {r}: {a.get('detail')}" for r, a in finished.items() if a.get("status") == "fail"
        ]
        if wrong:
            text += "; before it the backend returned wrong data: " + "; ".join(wrong)
        return text
    if outcome["how"] == "raised":
        raised = outcome.get("raised") or {}
        waiting = raised.get("waiting", [])
        return (
            f"rank {rank}: {raised.get('detail', 'the backend raised')}; ranks {waiting} never "
            "reached the end of the step (blocked in a collective this rank skipped) and were "
            "stopped"
        )
    return f"{who} was stopped during {step}"


def _describe_call_stall(rank: int, found: dict[str, Any], where: str) -> str:
    """A rank waiting in a backend call its peers returned from without it (``found``:
    ``stall.stalled_in_call``), ``where`` its step and call."""
    left = found.get("left", {})
    now = "; ".join(
        f"rank {r} is now in the backend's {p['call']}"
        if p.get("call")
        else f"rank {r} is past it, in the probe's own code"
        for r, p in left.items()
    )
    text = (
        f"rank {rank} stopped making progress in {where}: ranks {[int(r) for r in left]} "
        f"returned from that call without it (a collective they never joined; {now}): no "
        f"progress for {found.get('waited')} s after them, past the bound of "
        f"{found.get('bound')} s"
    )
    if found.get("peer_call_seconds"):
        text += f" (their slowest call of the step took {found['peer_call_seconds']} s)"
    wrong = [f"rank {r}: {d}" for r, d in (found.get("wrong") or {}).items()]
    if wrong:
        text += "; before it the backend returned wrong data: " + "; ".join(wrong)
    return text


def primary_failure(
    outcomes: dict[int, dict[str, Any]],
) -> tuple[int, dict[str, Any]] | None:
    """The failure to report: the earliest crash or exit, else a hang, an error, a stop."""
    for kinds in (("signal", "exit", "raised", "stall"), ("hang",), ("error",), ("stopped",)):
        found = [(o.get("time", 0.0), r, o) for r, o in outcomes.items() if o["how"] in kinds]
        if found:
            _, rank, outcome = min(found, key=lambda item: (item[0], item[1]))
            return rank, outcome
    return None


def report_unfinished(
    kind: ProbeKind,
    options: RunOptions,
    env: RankEnv,
    sel: Selection,
    own: Outcome,
    outcomes: dict[int, dict[str, Any]],
) -> int:
    """Rank 0's supervisor: the table and JSON for a run that did not finish (exit 3; 1 when
    the backend had returned wrong numbers before; what the probe reads in it otherwise,
    ``ProbeKind.unfinished``: check_ep's scenarios step when the backend refused views by
    ending its process, a precondition)."""
    found = primary_failure(outcomes)
    rank, failure = found if found is not None else (env.rank, own.to_json())
    names = kind.step_names
    current = failure.get("step") or names[0]
    done = [Step.from_json(obj) for obj in own.progress.get("steps", [])]
    index = names.index(current) if current in names else len(done)
    first = current == names[0]
    step = _unfinished_step(options, env, own, outcomes, rank, failure, current, first, done)
    if kind.unfinished is not None:
        step = kind.unfinished(step, Unfinished(options, own, outcomes, rank, failure))
    steps = [*done[:index], step, *(not_run(n, step) for n in names[index + 1 :])]
    code = exit_code_of(steps, options.require, kind.judged)
    if own.fault_log:
        print(own.fault_log.rstrip(), file=sys.stderr)
    sel.name = own.progress.get("backend", sel.name)
    meta = own.progress.get("meta", {})
    ranks = [{"rank": r, **lean(outcomes[r])} for r in sorted(outcomes)]
    environment = import_failure.environment(own.progress, failure)
    return finish(
        kind, options, env, sel, steps, meta, code, rank_outcomes=ranks, environment=environment
    )


def lean(outcome: dict[str, Any]) -> dict[str, Any]:
    """An outcome for the report, without the breadcrumbs the report holds elsewhere."""
    return {k: v for k, v in outcome.items() if k not in ("scenario_results", "scenario_found")}


def _unfinished_step(
    options: RunOptions,
    env: RankEnv,
    own: Outcome,
    outcomes: dict[int, dict[str, Any]],
    rank: int,
    failure: dict[str, Any],
    current: str,
    first: bool,
    done: list[Step],
) -> Step:
    """The step a crash, exit, hang, stall or one-sided raise ended, as the report shows it."""
    detail = _describe(rank, env.world, failure, options.timeout)
    hung = sorted(r for r, o in outcomes.items() if o["how"] == "hang")
    if failure["how"] == "hang" and len(hung) > 1:
        detail += f" (ranks {hung} all hung there)"
    stalled = sorted(r for r, o in outcomes.items() if o["how"] == "stall")
    if failure["how"] == "stall" and len(stalled) > 1:
        detail += f" (ranks {stalled} all stalled there)"
    # Wrong data a rank's checks found in this step before it ended this way, not yet said.
    found = failure.get("stall") or {}
    finished = found.get("finished") or {}
    said = set(found.get("wrong") or {})
    said |= {r for r, a in finished.items() if a.get("status") == "fail"}
    wrong_before = {
        r: o["wrong"].get("detail")
        for r, o in sorted(outcomes.items())
        if (o.get("wrong") or {}).get("step") == current and str(r) not in said
    }
    if wrong_before:
        lead = "before it the backend returned wrong data"
        lead = "; and" if lead in detail else f"; {lead}:"
        detail += f"{lead} " + "; ".join(f"rank {r}: {d}" for r, d in wrong_before.items())
    hint = _HINTS[failure["how"]]
    if failure["how"] == "error" and first:
        hint = import_failure.hint(failure, options, own.progress) or _HINTS["import_error"]
    if _supervise.OUT_OF_MEMORY in str(failure.get("signal")):
        hint = _supervise.OUT_OF_MEMORY_HINT
    raised = failure.get("raised") or {}
    # A stall after the backend returned wrong data on the ranks that finished is a failed
    # check (exit 1); one where nothing was wrong yet, a hang (3).
    wrong_data = failure["how"] == "stall" and (found.get("wrong_data") or bool(wrong_before))
    step = Step(
        current,
        Status.FAIL if wrong_data else Status.ERROR,
        seconds=float(raised.get("seconds", failure.get("seconds_in_step", 0.0))),
        detail=detail,
        hint=raised.get("hint") or hint,
        data={
            **raised.get("data", {}),
            "failure": {"rank": rank, **lean({k: v for k, v in failure.items() if k != "raised"})},
        },
    )
    if wrong_before and step.status == Status.ERROR:
        step.data["wrong_data"] = True  # the verdict stays "failed" (exit_code_of)
    static = next((d.data.get("static_libstdcxx") for d in done if d.name == "prerequisites"), None)
    if failure["how"] == "signal" and static:
        step.hint = (
            f"{', '.join(static)} carries its own libstdc++ (built with -static-libstdc++, e.g. "
            "by a compiler wrapper) beside the one torch loaded: two C++ runtimes in one process "
            "crash in iostream code (HybridEP did, in its buffer constructor). Rebuild it with "
            "the system compiler: CC=/usr/bin/gcc CXX=/usr/bin/g++"
        )
    return step
