"""``check-train --all-backends``: the same model trained with every backend venv under one
prefix, in turn, and one table to choose from.

Why this module exists: choosing a backend meant training with each by hand and comparing step
times, memory and losses (1.47x over the all-gather fallback, in the change that made DeepEP
the default). In an ``EP=all`` image every backend has its venv under ``/opt/venvs``; each
run here is that venv's own python running check_train with the same flags, so each backend
is judged in the environment it will train in, at the ranks it needs on the GPUs here (DeepEP
v1 at 2, 4 or 8; on one GPU its 2 ranks share it), and the runs' reports become one table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ep_image import backends, child_env, cli
from ep_image.probes._report import RESULT_WORDS, merge_exit_codes, write_report
from ep_image.probes.check_ep.launch import strip_flag
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


def visible_gpus(python: Path, options: TrainOptions) -> int:
    """The GPUs the runs will have: what a venv's torch counts (this python may have no
    torch); 0 with ``--device cpu`` or when it cannot tell."""
    if options.device == "cpu":
        return 0
    try:
        proc = subprocess.run(
            [str(python), "-c", _COUNT_GPUS],
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return 0
    lines = proc.stdout.split()
    return int(lines[-1]) if proc.returncode == 0 and lines and lines[-1].isdigit() else 0


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


def run_one(name: str, python: Path, argv: list[str], report: Path) -> dict[str, Any]:
    """One backend's run in its own venv; its report's summary (the exit code, and the report
    itself when one was written)."""
    cmd = [str(python), "-m", "ep_image.probes.check_train", "--backend", name, *argv]
    cmd += ["--json", str(report)]
    print(f"{PROG}: --all-backends: {name}: {' '.join(cmd)}", flush=True)
    code = subprocess.run(cmd, env=child_env(), check=False).returncode
    data = json.loads(report.read_text()) if report.is_file() else None
    return {"backend": name, "python": str(python), "argv": argv, "exit_code": code, "report": data}


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
    return {
        "backend": run["backend"],
        "exit_code": run["exit_code"],
        "result": report.get("result") or RESULT_WORDS.get(run["exit_code"], "no report"),
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
        "first_problem": bad[0] if bad else "",
    }


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
    with tempfile.TemporaryDirectory(prefix="check_train-all-") as tmp:
        # Each run's own report beside the combined one (train.json: train.deepep_v2.json).
        where = options.json.parent if options.json else Path(tmp)
        stem = options.json.stem if options.json else PROG
        gpus = visible_gpus(found[0][1], options)
        runs = [
            run_one(n, p, [*shared, *launch_flags(n, gpus, options)], where / f"{stem}.{n}.json")
            for n, p in found
        ]
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
                "rows": rows,
                "runs": runs,
                "exit_code": code,
                "result": RESULT_WORDS.get(code, "unknown"),
            },
        )
    return code
