"""Time make_venv's two whole-venv checks on NCCL EP's venv: the ABI check and the RECORD check.

Builds the venv once (uv, the lock's torch and nccl-extensions[cu13], hardlinked from uv's
cache), then times ``ep_image.native.abi.check`` (every extension of nccl-extensions bound to the
venv's libraries) and ``ep_image.build_steps._venv.dist_records.verify`` (every installed file
against its RECORD; both at ep_image's root before #47) with the ``ep_image`` of ``--source``
(a checkout of any commit: this commit's, or an older one for the figure before a change), each
``--runs`` times, the file cache warm after the first.

    python3 evidence/2026-12-05-cpu/venv_check_timing.py --source . --out after.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DISTRIBUTION = "nccl-extensions"


def locked(name: str) -> str:
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    return next(p["version"] for p in lock["package"] if p["name"] == name)


def make_venv(venv: Path) -> None:
    if (venv / "pyvenv.cfg").is_file():
        return
    env = {**os.environ, "VIRTUAL_ENV": str(venv), "UV_LINK_MODE": "hardlink"}
    subprocess.run(["uv", "venv", "-q", "--python", sys.executable, str(venv)], check=True)
    packages = [f"torch=={locked('torch')}", f"{DISTRIBUTION}[cu13]=={locked(DISTRIBUTION)}"]
    subprocess.run(["uv", "pip", "install", "-q", *packages], check=True, env=env)


def measure(source: Path, venv: Path, runs: int) -> dict[str, object]:
    """Each check in a fresh Python that imports ``ep_image`` from ``source``."""
    code = f"""
import json, sys, time
from pathlib import Path
sys.path.insert(0, {str(source)!r})
try:
    from ep_image.build_steps._venv import dist_records
    from ep_image.native import abi
except ImportError:  # a checkout from before #47 moved them out of ep_image's root
    from ep_image import abi, dist_records
site = next(Path({str(venv)!r}).glob("lib/python3*/site-packages"))
t = time.monotonic(); results = abi.check(site, Path({str(venv)!r}) / "bin" / "python",
                                          [{DISTRIBUTION!r}])
abi_s = time.monotonic() - t
t = time.monotonic(); problems = dist_records.verify(site); records_s = time.monotonic() - t
print(json.dumps({{"abi_seconds": abi_s, "extensions": len(results),
                  "abi_ok": all(r.ok for r in results), "records_seconds": records_s,
                  "record_problems": len(problems)}}))
"""
    samples = []
    for _ in range(runs):
        start = os.times()
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True).stdout  # fmt: skip
        end = os.times()
        sample = json.loads(out.strip().splitlines()[-1])
        cpu = end.children_user - start.children_user + end.children_system - start.children_system
        sample["cpu_seconds"] = round(cpu, 2)
        samples.append(sample)
    commit = subprocess.run(["git", "-C", str(source), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    return {"source_commit": commit, "runs": samples}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, required=True, help="a checkout: its ep_image")
    parser.add_argument("--venv", type=Path, default=Path("/tmp/ep-venv-check-timing"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    argv = sys.argv[1:]
    make_venv(args.venv)
    data = measure(args.source.resolve(), args.venv, args.runs)
    data.update({
        "command": " ".join(["python3", "evidence/2026-12-05-cpu/venv_check_timing.py", *argv]),
        "cpus": os.cpu_count(), "load_average_at_start": os.getloadavg(),
        "python": platform.python_version(), "torch": locked("torch"),
        DISTRIBUTION: locked(DISTRIBUTION),
    })  # fmt: skip
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
