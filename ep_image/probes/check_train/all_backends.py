"""``check-train --all-backends``: the same model trained with every backend venv under one
prefix, in turn, and one table to choose from.

Why this module exists: choosing a backend meant training with each by hand and comparing step
times, memory and losses (1.47x over the all-gather fallback, in the change that made DeepEP
the default). In an ``EP=all`` image every backend has its venv under ``/opt/venvs``; each
run here is that venv's own python running check_train with the same flags, so each backend
is judged in the environment it will train in, at the ranks it needs on the GPUs here (DeepEP
v1 at 2, 4 or 8; on one GPU its 2 ranks share it), and the runs' reports become one table.
Each run is bounded (``deadline``) and ends with the launcher however that ends (children.py):
a venv whose python hangs or crashes is a row that says how it ended, not a launcher that
waits forever or leaves it running.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from ep_image import backends, child_env, cli
from ep_image.probes._ranks.launch import strip_flag
from ep_image.probes._report import (
    EXIT_UNUSABLE,
    RESULT_WORDS,
    merge_exit_codes,
    write_report,
)
from ep_image.probes.check_train.children import Keeper, stop_on_signals
from ep_image.probes.check_train.steps import STEP_NAMES
from ep_image.probes.check_train.types import PROG, TrainOptions

DEFAULT_PREFIX = "/opt/venvs"


def prefix_of(options: TrainOptions) -> Path:
    return Path(options.prefix or os.environ.get("EP_PREFIX") or DEFAULT_PREFIX)


def venvs_under(prefix: Path) -> list[tuple[str, Path]]:
    """``(backend, its venv's python)`` for every registry backend with a venv under
    ``prefix``, in the registry's order."""
    found = []
    for name in backends.BACKEND_NAMES:
        python = prefix / name / "bin" / "python"
        if python.is_file() and os.access(python, os.X_OK):
            found.append((name, python))
    return found


def child_argv(argv: list[str]) -> list[str]:
    """The flags every run shares: the command line without the ones this module owns."""
    out = [a for a in argv if a != "--all-backends"]
    for flag in ("--prefix", "--json"):
        out = strip_flag(out, flag)
    return out


#: Counts the GPUs a venv's torch sees, as its ranks will (CUDA_VISIBLE_DEVICES included).
_COUNT_GPUS = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"


def deadline(options: TrainOptions) -> tuple[float, str]:
    """Seconds one backend's run may take, and how that was reached: --timeout for each of
    its steps (its own supervisor calls a step that runs longer a hang and ends the run) and
    one more for its start (the interpreter, torch's import, the ranks' rendezvous). Past it
    the run is stopped with everything it started, and its row says it timed out."""
    parts = len(STEP_NAMES) + 1
    seconds = options.timeout * parts
    return seconds, f"the deadline, {seconds:g} s: --timeout {options.timeout:g} s x {parts}"


def visible_gpus(pythons: list[Path], options: TrainOptions, keeper: Keeper) -> int:
    """The GPUs the runs will have: what a venv's torch counts (this python may have no
    torch), asked of each venv in turn until one answers within --timeout; 0 with
    ``--device cpu`` or when none can tell."""
    if options.device == "cpu":
        return 0
    for python in pythons:
        try:
            ended = keeper.run(
                [str(python), "-c", _COUNT_GPUS],
                env=child_env(),
                deadline=options.timeout,
                capture=True,
            )
        except OSError:
            continue
        lines = ended.stdout.split()
        if ended.returncode == 0 and lines and lines[-1].isdigit():
            return int(lines[-1])
    return 0


def ranks_for(name: str, gpus: int) -> tuple[int, int]:
    """``(ranks, ranks per GPU)`` to start backend ``name`` at on ``gpus`` GPUs (0: as the
    flags say, one rank without them): the most ranks its spec allows that the GPUs hold, one
    a GPU; where the GPUs hold fewer than its fewest, its fewest, sharing the GPUs (where its
    spec says ranks may)."""
    if gpus <= 0:
        return 0, 1
    spec = backends.spec(name)
    allowed = spec.world_sizes or tuple(range(spec.min_ranks, max(gpus, spec.min_ranks) + 1))
    fits = [n for n in allowed if n <= gpus]
    if fits:
        return max(fits), 1
    fewest = spec.fewest_ranks
    if not spec.shares_gpu:  # it refuses shared GPUs: its run says what it needs
        return fewest, 1
    return fewest, -(-fewest // gpus)


def launch_flags(name: str, gpus: int, options: TrainOptions) -> list[str]:
    """The flags that start backend ``name``'s ranks; none where the command line already
    says how many ranks (every backend then runs as it says) or one rank is its run."""
    if options.nproc_per_node or options.ranks_per_gpu != 1:
        return []
    ranks, per_gpu = ranks_for(name, gpus)
    if ranks <= 1:
        return []
    flags = ["--nproc-per-node", str(ranks)]
    return flags + (["--ranks-per-gpu", str(per_gpu)] if per_gpu > 1 else [])


def run_one(
    name: str,
    python: Path,
    argv: list[str],
    report: Path,
    keeper: Keeper,
    limit: tuple[float, str],
) -> dict[str, Any]:
    """One backend's run in its own venv, within ``limit`` (``deadline``); its report's
    summary: the exit code, the report itself when one was written, and how the run ended
    where its report does not say (``ended``: timed out, killed by a signal, the exit status
    without a report, or a status its report did not give)."""
    cmd = [str(python), "-m", "ep_image.probes.check_train", "--backend", name, *argv]
    cmd += ["--json", str(report)]
    print(f"{PROG}: --all-backends: {name}: {' '.join(cmd)}", flush=True)
    report.unlink(missing_ok=True)  # an earlier run's must not stand for this one
    try:
        ended = keeper.run(cmd, env=child_env(), deadline=limit[0])
    except OSError as exc:  # not executable after all, a bad interpreter line
        return _run_record(name, python, argv, EXIT_UNUSABLE, None, f"did not start: {exc}")
    data = _read_report(report) if not ended.timed_out else None
    code = ended.returncode
    how = ""
    if data is None:
        how = ended.how(limit[1])
        how += "" if ended.timed_out else " without a report"
        # A run that said nothing did not show that the backend works: unusable, unless its
        # own command line was refused (2).
        code = code if code == cli.EXIT_USAGE else EXIT_UNUSABLE
    elif code != data.get("exit_code", code):  # a crash on the way out, after the report
        how = f"{ended.how()} after its report (which says {data.get('result')})"
    record = _run_record(name, python, argv, code, data, how)
    record.update(returncode=ended.returncode, seconds=round(ended.seconds, 3))
    return record


def _run_record(
    name: str, python: Path, argv: list[str], code: int, data: dict[str, Any] | None, how: str
) -> dict[str, Any]:
    return {
        "backend": name,
        "python": str(python),
        "argv": argv,
        "exit_code": code,
        "ended": how,
        "report": data,
    }


def _read_report(path: Path) -> dict[str, Any] | None:
    """A run's JSON report; None where it wrote none (or not a whole one)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def summary_row(run: dict[str, Any]) -> dict[str, Any]:
    """The table's numbers for one run, read from its report."""
    report = run["report"] or {}
    n = report.get("numbers", {})
    bad = [
        f"{s['name']}: {s['detail']}"
        for s in report.get("steps", [])
        if s["status"] in ("fail", "error", "missing", "skip")
    ]
    medians = n.get("median_step_seconds", {})
    argv = run.get("argv", [])
    per_gpu = int(argv[argv.index("--ranks-per-gpu") + 1]) if "--ranks-per-gpu" in argv else 1
    frameworks = n.get("recompute_frameworks") or {}
    ended = run.get("ended", "")
    result = report.get("result") or _result_without_report(ended)
    return {
        "backend": run["backend"],
        "exit_code": run["exit_code"],
        "result": result,
        "ended": ended,
        "ranks": report.get("world_size"),
        "ranks_per_gpu": per_gpu,
        "step_seconds": n.get("backend_step_seconds", medians.get("backend")),
        "fallback_step_seconds": n.get("fallback_step_seconds", medians.get("fallback")),
        "speedup": n.get("speedup"),
        "tokens_per_second": n.get("backend_tokens_per_second"),
        "peak_bytes": n.get("backend_peak_bytes"),
        "loss_rel_diff": n.get("agreement_max_loss_rel_diff"),
        "label": n.get("label"),
        "recompute_findings": n.get("recompute_findings"),
        "recompute_frameworks": frameworks,
        "first_problem": ended or (bad[0] if bad else ""),
    }


def _result_without_report(ended: str) -> str:
    """The result column of a run that wrote no report, by how it ended."""
    if ended.startswith("timed out"):
        return "timed out"
    if ended.startswith("killed by"):
        return "crashed"
    return "no report"


def _ranks_cell(row: dict[str, Any]) -> str:
    """The ranks a run ran at: ``2`` or ``2 (2/GPU)``; ``-`` without a report."""
    if row["ranks"] is None:
        return "-"
    shared = f" ({row['ranks_per_gpu']}/GPU)" if row["ranks_per_gpu"] > 1 else ""
    return f"{row['ranks']}{shared}"


def _recompute_line(row: dict[str, Any]) -> str:
    """What the recomputes found, where some came back otherwise than their forwards."""
    found = {k: v for k, v in (row["recompute_findings"] or {}).items() if v and k != "same"}
    usable = row["recompute_frameworks"]
    if not found or not usable:
        return ""
    what = ", ".join(f"{k} {v}" for k, v in found.items())
    return (
        f"recompute: {what}; with its own handle: {usable['dispatch_with_its_handle']}, with "
        f"the forward's: {usable['dispatch_with_forward_handle']}"
    )


def _cell(value: Any, fmt: str, width: int, scale: float = 1.0) -> str:
    text = "-" if value is None else format(value * scale, fmt)
    return text.rjust(width)


#: The table's columns: title, the row's key, format, width, scale.
COLUMNS = (
    ("ms/step", "step_seconds", ".1f", 9, 1e3),
    ("fallback", "fallback_step_seconds", ".1f", 9, 1e3),
    ("speedup", "speedup", ".2f", 8, 1.0),
    ("tokens/s", "tokens_per_second", ",.0f", 10, 1.0),
    ("peak MiB", "peak_bytes", ".1f", 9, 2.0**-20),
    ("loss diff", "loss_rel_diff", ".2g", 10, 1.0),
)


def render(rows: list[dict[str, Any]], prefix: Path, code: int) -> str:
    head = f"{'backend':<12} {'result':<10} {'ranks':<10}" + "".join(
        f" {title:>{width}}" for title, _, _, width, _ in COLUMNS
    )
    lines = [f"{PROG} --all-backends (venvs under {prefix})", f"  {head}"]
    for r in rows:
        cells = "".join(
            " " + _cell(r[key], fmt, width, scale) for _, key, fmt, width, scale in COLUMNS
        )
        lines.append(f"  {r['backend']:<12} {r['result']:<10} {_ranks_cell(r):<10}{cells}")
        for extra in (_recompute_line(r), r["first_problem"]):
            if extra:
                lines.append(f"  {'':<12} {extra}")
    labels = sorted({r["label"] for r in rows if r["label"]})
    if labels:
        lines.append(f"  times: {'; '.join(labels)}")
    lines.append(f"  result: {RESULT_WORDS.get(code, 'unknown')} (exit {code})")
    return "\n".join(lines)


def run(options: TrainOptions, argv: list[str]) -> int:
    """Every backend venv under the prefix, in turn; one table; the most severe exit code."""
    prefix = prefix_of(options)
    found = venvs_under(prefix)
    if not found:
        raise cli.FixableError(
            f"no backend venv under {prefix} (looked for {', '.join(backends.BACKEND_NAMES)})",
            "give --prefix (or EP_PREFIX) the directory that holds the venvs "
            "(the image's /opt/venvs, or host mode's --prefix)",
            exit_code=4,
        )
    shared = child_argv(argv)
    limit = deadline(options)
    keeper = Keeper()
    try:
        with stop_on_signals(), tempfile.TemporaryDirectory(prefix="check_train-all-") as tmp:
            keeper.hold_path(tmp)
            # Each run's own report beside the combined one (train.json: train.deepep_v2.json).
            where = options.json.parent if options.json else Path(tmp)
            stem = options.json.stem if options.json else PROG
            gpus = visible_gpus([p for _, p in found], options, keeper)
            runs = []
            for n, p in found:
                report = where / f"{stem}.{n}.json"
                flags = [*shared, *launch_flags(n, gpus, options)]
                runs.append(run_one(n, p, flags, report, keeper, limit))
        keeper.release_path(tmp)
    finally:
        keeper.close()
    code = merge_exit_codes(r["exit_code"] for r in runs)
    rows = [summary_row(r) for r in runs]
    print(render(rows, prefix, code), flush=True)
    if options.json:
        write_report(
            options.json,
            {
                "schema_version": 1,
                "probe": PROG,
                "all_backends": True,
                "prefix": str(prefix),
                "python": sys.executable,
                "gpus": gpus,
                "deadline_seconds": limit[0],
                "rows": rows,
                "runs": runs,
                "exit_code": code,
                "result": RESULT_WORDS.get(code, "unknown"),
            },
        )
    return code
