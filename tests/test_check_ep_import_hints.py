"""check_ep's fix for a failure while the backend process imports: by where it was raised.

Why: every error in the import step got "the probe's own imports failed in this python: run it
with the python of an environment that holds the project", also when the python was right and
the fault was a ``--backend-class`` file that raises at import, or a ``torch`` on PYTHONPATH that
shadows the venv's; and the report's ``loaded_outside_venv`` stayed empty with that torch
loaded. Each case runs the real probe in a subprocess and reads its JSON report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import clean_env

from ep_image import child_env

PROBE = [sys.executable, "-m", "ep_image.probes.check_ep"]
OLD_HINT = "the probe's own imports failed"


def run(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> dict:
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [*PROBE, *args, "--scenarios", "none", "--json", str(report)],
        env=child_env(env or clean_env()), cwd=tmp_path, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 3, proc.stdout + proc.stderr
    return json.loads(report.read_text())


def import_step(report: dict) -> dict:
    return next(s for s in report["steps"] if s["name"] == "import")


def test_a_backend_class_that_raises_at_import_is_named(tmp_path: Path) -> None:
    broken = tmp_path / "my_backend.py"
    broken.write_text("raise RuntimeError('my backend module is broken')\n")
    step = import_step(run(tmp_path, "--backend-class", f"{broken}:Backend"))
    assert step["status"] == "error", step
    assert "my backend module is broken" in step["detail"]
    assert OLD_HINT not in step["hint"], step["hint"]
    assert str(broken) in step["hint"] and "--backend-class" in step["hint"], step["hint"]


@pytest.mark.parametrize("fake", ["raises", "hollow"])
def test_a_torch_on_pythonpath_that_shadows_the_venvs_is_named(tmp_path: Path, fake: str) -> None:
    """A fake torch first on PYTHONPATH: one that raises when imported, and one that imports but
    is not torch. The hint names it and PYTHONPATH; the report lists it as loaded from outside
    the venv."""
    shadow = tmp_path / "shadow"
    (shadow / "torch").mkdir(parents=True)
    init = shadow / "torch" / "__init__.py"
    init.write_text(
        "raise ImportError('a fake torch')\n" if fake == "raises" else "__version__ = '0.0'\n"
    )
    env = clean_env(PYTHONPATH=os.pathsep.join([str(shadow), os.environ["PYTHONPATH"]]))
    report = run(tmp_path, "--backend", "torch", env=env)
    step = import_step(report)
    assert step["status"] == "error", step
    assert OLD_HINT not in step["hint"], step["hint"]
    assert str(shadow / "torch") in step["hint"] and "PYTHONPATH" in step["hint"], step["hint"]
    modules = report["environment"]["loaded_outside_venv"]["modules"]
    assert any(str(init) in m for m in modules), modules


def test_a_deep_ep_on_pythonpath_that_raises_is_not_a_missing_gpu(tmp_path: Path) -> None:
    """A ``deep_ep`` shadowing the venv's (here the only one) raises when imported. Before:
    "deep_ep is installed but does not load without a GPU", a skip (exit 5) on a machine
    without one. Now an error naming the file and PYTHONPATH."""
    site = tmp_path / "site"
    (site / "deep_ep").mkdir(parents=True)
    (site / "deep_ep" / "__init__.py").write_text("raise ImportError('a broken deep_ep')\n")
    (site / "deep_ep" / "buffer.py").write_text("class Buffer: ...\n")  # DeepEP v1's layout
    env = clean_env(PYTHONPATH=os.pathsep.join([str(site), os.environ["PYTHONPATH"]]))
    step = import_step(run(tmp_path, env=env))
    assert step["status"] == "error", step
    assert "without a GPU" not in step["detail"], step["detail"]
    assert str(site / "deep_ep") in step["hint"] and "PYTHONPATH" in step["hint"], step["hint"]
