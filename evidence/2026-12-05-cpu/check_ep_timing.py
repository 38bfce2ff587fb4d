"""check_ep's time to a verdict on the CPU path, for a working backend and for wrong ones.

Why: docs/benchmarks.md says what a verdict costs, working or not; this is the command behind
its table and this folder's check_ep_timing.json is the data. Each case is the whole command
(`python -m ep_image.probes.check_ep ...`, ranks started by the probe itself, the torch
reference over gloo with the CPU layer defaults), one untimed warm-up, then ``--runs`` timed
runs; every run's wall seconds, exit code, verdict, each step's own seconds and the load
average when it started are kept. Run from the repository root:

    uv run --frozen --group dev python3 evidence/2026-12-05-cpu/check_ep_timing.py \
        --runs 5 --out evidence/2026-12-05-cpu/check_ep_timing.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BROKEN = "tests/fixtures/broken_backends.py"

#: (the backend, in words; the arguments after ``-m ep_image.probes.check_ep``).
CASES: tuple[tuple[str, list[str]], ...] = (
    ("works", ["--backend", "torch", "--nproc-per-node", "2"]),
    ("works, bf16", ["--backend", "torch", "--nproc-per-node", "4", "--dtype", "bfloat16"]),
    ("wrong on rank 0 only",
     ["--backend-class", f"{BROKEN}:CombineOneTokenShortOnRankZero", "--nproc-per-node", "2"]),
    ("keeps its running sum in bf16",
     ["--backend-class", f"{BROKEN}:AccumulatesCombineInTokenDtype", "--nproc-per-node", "4",
      "--dtype", "bfloat16"]),
    ("raises on the last rank where nothing arrives",
     ["--backend-class", f"{BROKEN}:RaisesWhereNothingArrives", "--nproc-per-node", "2"]),
)  # fmt: skip


def run_once(args: list[str], report: Path, timeout: float) -> dict[str, Any]:
    """One whole command: its wall seconds, exit code and what its report says."""
    report.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests" / "fixtures")])
    load = os.getloadavg()
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "ep_image.probes.check_ep", *args, "--json", str(report)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    seconds = time.monotonic() - start
    data = json.loads(report.read_text()) if report.exists() else {}
    return {
        "seconds": round(seconds, 2),
        "exit_code": proc.returncode,
        "result": data.get("result"),
        "failed_steps": [s["name"] for s in data.get("steps", []) if s["status"] != "pass"],
        "step_seconds": {s["name"]: s["seconds"] for s in data.get("steps", [])},
        "load_at_start": [round(x, 2) for x in load],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="check_ep_timing.py", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="timed runs per case (default: 5)")
    parser.add_argument("--out", type=Path, required=True, help="write the JSON data here")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run at most")
    args = parser.parse_args(argv)
    import torch  # its version, for the record

    cases = []
    with tempfile.TemporaryDirectory(prefix="check-ep-timing-") as tmp:
        report = Path(tmp) / "report.json"
        for backend, case_args in CASES:
            run_once(case_args, report, args.timeout)  # warm-up: page cache, bytecode
            runs = [run_once(case_args, report, args.timeout) for _ in range(args.runs)]
            walls = [r["seconds"] for r in runs]
            cases.append({
                "command": "python -m ep_image.probes.check_ep " + " ".join(case_args),
                "backend": backend,
                "runs": runs,
                "wall_seconds": {"min": min(walls), "median": statistics.median(walls),
                                 "max": max(walls)},
            })  # fmt: skip
            print(f"{backend}: {cases[-1]['wall_seconds']} exit {runs[0]['exit_code']}", flush=True)
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "ep_image", "tests/fixtures"],
        cwd=ROOT, capture_output=True, text=True, check=False,
    ).stdout.strip()  # fmt: skip
    data = {
        "what": "check_ep, CPU path: wall seconds of the whole command, after one warm-up",
        "commit": commit,
        "uncommitted_changes_to_the_probe": bool(dirty),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "system": platform.system()},
        "cases": cases,
    }  # fmt: skip
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
