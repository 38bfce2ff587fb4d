"""Shared test fixtures: the project's paths and one way to run a probe for real.

Why this file exists: several test modules run the probes as a user would (a subprocess,
real process groups, the real command line) and read the JSON report back. One runner here
keeps them running the probes the same way, with torchrun's variables removed from the
environment so a test never joins someone else's job.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _fault_inject import build_shim

from ep_image import child_env

# After a failed run: prune the kept temporary directory and say where it is. Children's
# temporary files: one directory per run, removed at its end. A failure named as it happens.
pytest_plugins = ["_tmp_retention", "_session_tmp", "_parallel", "_progress"]

# A run started in the background (`cmd &` in a script, nohup) inherits SIGINT ignored, and so
# would every make_venv a test starts: the tests of Ctrl-C need it as a terminal delivers it.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_configure(config: pytest.Config) -> None:
    """Before any test, remove what killed runs left: dockerd and buildah state directories
    nobody holds, with their processes, mounts and (dockerd's) files under /run and build
    secrets (tests/_owned_dirs.py). Once per run: in the controller, not in each worker."""
    if getattr(config, "workerinput", None) is not None:
        return
    import _docker_engine
    import _owned_dirs

    # The prefixes of tests/_docker_engine.py's daemons and tests/test_image_build.py's storages.
    _owned_dirs.sweep_killed_runs({"docker-": _docker_engine.leftovers, "store-": None})


ROOT = Path(__file__).resolve().parents[1]
# Child Pythons (probes, ranks, make_venv) import this checkout's ep_image and the fixtures, as
# pytest itself does (pyproject.toml's pythonpath).
os.environ["PYTHONPATH"] = os.pathsep.join(
    [child_env()["PYTHONPATH"], str(ROOT / "tests" / "fixtures")]
)
FIXTURES = ROOT / "tests" / "fixtures"
BROKEN = FIXTURES / "broken_backends.py"

_LAUNCH_VARS = {
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_RUN_ID",
}


def clean_env(**extra: str) -> dict[str, str]:
    """The caller's environment without any torchrun variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env.update(extra)
    return env


@dataclass
class ProbeRun:
    """A finished probe process and its JSON report (None when it wrote none)."""

    proc: subprocess.CompletedProcess[str]
    report: dict[str, Any] | None

    @property
    def output(self) -> str:
        return self.proc.stdout + self.proc.stderr

    def statuses(self) -> dict[str, str]:
        assert self.report is not None, self.output
        return {s["name"]: s["status"] for s in self.report["steps"]}

    def step(self, name: str) -> dict[str, Any]:
        assert self.report is not None, self.output
        return next(s for s in self.report["steps"] if s["name"] == name)


def run_probe_in(
    tmp_path: Path,
    script: str,
    *args: str,
    launcher: list[str] | None = None,
    python: list[str] | None = None,
    env: dict[str, str] | None = None,
    timeout: int = 300,
) -> ProbeRun:
    """Run ``python -m ep_image.probes.<script> args --json <tmp>/report.json`` as a user would.

    ``python`` replaces the interpreter (a venv's, or ``python -I -S``); ``launcher`` goes
    between it and the script (``-m torch.distributed.run ...``).
    """
    report = tmp_path / "report.json"
    report.unlink(missing_ok=True)
    cmd = [
        *(python or [sys.executable]),
        *(launcher or []),
        "-m",
        f"ep_image.probes.{Path(script).stem}",
        *args,
        "--json",
        str(report),
    ]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(env or clean_env()),
        cwd=tmp_path,
    )
    data = json.loads(report.read_text()) if report.exists() else None
    return ProbeRun(proc, data)


def assert_unwritable_report_is_bad_usage(tmp_path: Path, probe: str, *args: str) -> None:
    """``--json`` that cannot be written is bad usage, found when the flags are parsed: one
    line and exit 2 before any work (no table, no report), never a verdict lost at the end.
    Both paths fail for root too: a directory under a file, and a directory itself."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for path, phrase in (
        (blocker / "report.json", "cannot make the directory"),
        (tmp_path, "is a directory"),
    ):
        cmd = [sys.executable, "-m", f"ep_image.probes.{probe}", *args, "--json", str(path)]
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=120,
            env=child_env(clean_env()),
            cwd=tmp_path,
        )
        assert proc.returncode == 2, proc.stdout + proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, proc.stderr
        assert lines[0].startswith(f"{probe}: usage error: argument --json: "), lines[0]
        assert phrase in lines[0] and "Traceback" not in proc.stderr
        assert proc.stdout == "", proc.stdout


@pytest.fixture
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fault-injection shim (tests/_fault_inject.py), compiled for the test that asks: the
    dedup tests' crashes and vanishing files."""
    library = build_shim(tmp_path_factory.mktemp("shim"))
    if library is None:
        pytest.skip("needs gcc (or cc) to build the fault-injection shim")
    return library


@pytest.fixture
def check_ep(tmp_path: Path):
    """Run check_ep: ``check_ep(*args, nproc=N, torchrun=N, env=..., timeout=...)``.

    ``nproc`` uses the probe's own ``--nproc-per-node``; ``torchrun`` starts the ranks with
    the real ``torchrun`` command instead.
    """

    def run(
        *args: str,
        nproc: int = 0,
        torchrun: int = 0,
        env: dict[str, str] | None = None,
        timeout: int = 300,
    ) -> ProbeRun:
        extra = ["--nproc-per-node", str(nproc)] if nproc else []
        launcher = (
            ["-m", "torch.distributed.run", "--nproc-per-node", str(torchrun)] if torchrun else None
        )
        return run_probe_in(
            tmp_path, "check_ep.py", *args, *extra, launcher=launcher, env=env, timeout=timeout
        )

    return run
