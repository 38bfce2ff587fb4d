"""How long `uv sync --frozen --extra deepep_v2` takes and what disk it costs, by uv cache and
link mode: from an empty cache, then warm with hardlinks (uv's default on Linux), then warm
with copies (what an image layer and host mode do).

Why: docs/benchmarks.md quotes these figures; this is their command and this folder's
uv_sync_timing.json their data. Everything it makes (a uv cache, three venvs) lives in one
temporary directory on the file system of ``--work`` (the venvs and the cache must share one
for hardlinks) and is removed at the end. Needs uv on PATH and the network to PyPI; about
11 GB of free disk while it runs. Run from the repository root:

    python3 scripts/bootstrap.py -- python3 evidence/2026-12-05-cpu/uv_sync_timing.py \
        --out evidence/2026-12-05-cpu/uv_sync_timing.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
EXTRA = "deepep_v2"


def du_bytes(*paths: Path) -> int:
    """Disk used by ``paths`` together (an inode shared between them counted once)."""
    out = subprocess.run(
        ["du", "-scB1", *map(str, paths)], capture_output=True, text=True, check=True
    ).stdout
    return int(out.strip().splitlines()[-1].split()[0])


def sync(cache: Path, venv: Path, link_mode: str) -> dict[str, Any]:
    env = {
        **os.environ,
        "UV_CACHE_DIR": str(cache),
        "UV_LINK_MODE": link_mode,
        "UV_PROJECT_ENVIRONMENT": str(venv),
    }
    load = os.getloadavg()
    start = time.monotonic()
    proc = subprocess.run(
        ["uv", "sync", "--frozen", "--extra", EXTRA],
        cwd=ROOT, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    seconds = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr
    prepared = re.search(r"Prepared (\d+) packages? in ([\d.]+m?s)", proc.stderr)
    return {
        "link_mode": link_mode,
        "seconds": round(seconds, 2),
        "prepared": prepared.group(0) if prepared else None,
        "venv_bytes": du_bytes(venv),
        "load_at_start": [round(x, 2) for x in load],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="uv_sync_timing.py", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="write the JSON data here")
    parser.add_argument("--work", type=Path, default=None, help="where to make the temporary tree")
    args = parser.parse_args(argv)
    uv_version = subprocess.run(["uv", "--version"], capture_output=True, text=True, check=True)
    work = Path(tempfile.mkdtemp(prefix="uv-sync-timing-", dir=args.work))
    try:
        cache = work / "cache"
        runs = []
        cold = sync(cache, work / "cold", "hardlink")
        cold["cache"] = "empty"
        cold["new_disk_bytes"] = du_bytes(cache, work / "cold")
        runs.append(cold)
        warm = sync(cache, work / "warm-hardlink", "hardlink")
        warm["cache"] = "warm"
        warm["new_disk_bytes"] = du_bytes(cache, work / "cold", work / "warm-hardlink") - du_bytes(
            cache, work / "cold"
        )
        runs.append(warm)
        before = du_bytes(cache, work / "cold", work / "warm-hardlink")
        copy = sync(cache, work / "warm-copy", "copy")
        copy["cache"] = "warm"
        copy["new_disk_bytes"] = (
            du_bytes(cache, work / "cold", work / "warm-hardlink", work / "warm-copy") - before
        )
        runs.append(copy)
        apparent = subprocess.run(
            ["du", "-sB1", "--apparent-size", str(work / "warm-copy")],
            capture_output=True, text=True, check=True,
        ).stdout.split()[0]  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    data = {
        "what": f"uv sync --frozen --extra {EXTRA}: wall seconds and disk",
        "uv": uv_version.stdout.strip(),
        "cpus": os.cpu_count(),
        "venv_apparent_bytes": int(apparent),
        "runs": runs,
    }
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    for run in runs:
        print(run, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
