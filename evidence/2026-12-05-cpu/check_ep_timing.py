"""check_ep's (and check_train's) time to a verdict on the CPU path, for a working backend and
for wrong ones.

Why: docs/benchmarks.md says what a verdict costs, working or not; this is the command behind
its tables and this folder's check_ep_timing.json and check_train_timing.json are the data.
Each case is the whole command (`python -m ep_image.probes.<probe> ...`, ranks started by the
probe itself, the torch reference over gloo with the CPU defaults), one untimed warm-up, then
``--runs`` timed runs; every run's wall seconds, exit code, verdict, each step's own seconds,
check_train's step times of the backend and the fallback, and the load average when it
started are kept. Run from the repository root:

    uv run --frozen --group dev python3 evidence/2026-12-05-cpu/check_ep_timing.py \
        --runs 5 --out evidence/2026-12-05-cpu/check_ep_timing.json
    uv run --frozen --group dev python3 evidence/2026-12-05-cpu/check_ep_timing.py \
        --probe check_train --runs 3 --out evidence/2026-12-05-cpu/check_train_timing.json
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
TRAINING = "tests/fixtures/broken_training.py"
#: check_train's fault cases: the tests' smaller model (6 steps, the fewest a leak is read from).
SMALL = ["--tokens", "128", "--seq", "64", "--hidden", "32", "--steps", "6"]

#: (the backend, in words; the arguments after ``-m ep_image.probes.<probe>``), per probe.
CHECK_EP_CASES: tuple[tuple[str, list[str]], ...] = (
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
CHECK_TRAIN_CASES: tuple[tuple[str, list[str]], ...] = (
    ("works", ["--backend", "torch", "--nproc-per-node", "2"]),
    ("works, 4 ranks", ["--backend", "torch", "--nproc-per-node", "4"]),
    ("a recompute that gets one row fewer",
     ["--backend-class", f"{TRAINING}:FewerRowsOnRecompute", *SMALL, "--nproc-per-node", "2"]),
    ("combine's backward wrong only after a recompute",
     ["--backend-class", f"{TRAINING}:CombineBackwardWrongAfterRecompute", *SMALL,
      "--nproc-per-node", "2"]),
    ("raises on rank 1 at the third step",
     ["--backend-class", f"{TRAINING}:RaisesAtThirdStepOnRankOne", *SMALL,
      "--nproc-per-node", "2"]),
)  # fmt: skip
CASES = {"check_ep": CHECK_EP_CASES, "check_train": CHECK_TRAIN_CASES}


def run_once(probe: str, args: list[str], report: Path, timeout: float) -> dict[str, Any]:
    """One whole command: its wall seconds, exit code and what its report says."""
    report.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests" / "fixtures")])
    load = os.getloadavg()
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", f"ep_image.probes.{probe}", *args, "--json", str(report)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    seconds = time.monotonic() - start
    data = json.loads(report.read_text()) if report.exists() else {}
    return {
        "seconds": round(seconds, 2),
        "exit_code": proc.returncode,
        "result": data.get("result"),
        "failed_steps": [
            s["name"] for s in data.get("steps", []) if s["status"] not in ("pass", "info")
        ],
        "step_seconds": {s["name"]: s["seconds"] for s in data.get("steps", [])},
        "training": {
            k: data.get("numbers", {}).get(k)
            for k in ("median_step_seconds", "speedup")
            if k in data.get("numbers", {})
        },
        "load_at_start": [round(x, 2) for x in load],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="check_ep_timing.py", description=__doc__.split("\n")[0])
    parser.add_argument("--probe", choices=sorted(CASES), default="check_ep")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per case (default: 5)")
    parser.add_argument("--out", type=Path, required=True, help="write the JSON data here")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run at most")
    args = parser.parse_args(argv)
    import torch  # its version, for the record

    cases = []
    with tempfile.TemporaryDirectory(prefix="probe-timing-") as tmp:
        report = Path(tmp) / "report.json"
        for backend, case_args in CASES[args.probe]:
            run_once(args.probe, case_args, report, args.timeout)  # warm-up: cache, bytecode
            runs = [run_once(args.probe, case_args, report, args.timeout) for _ in range(args.runs)]
            walls = [r["seconds"] for r in runs]
            cases.append({
                "command": f"python -m ep_image.probes.{args.probe} " + " ".join(case_args),
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
        "what": f"{args.probe}, CPU path: wall seconds of the whole command, after one warm-up",
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
