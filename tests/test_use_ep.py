"""scripts/use-ep (POSIX sh) against a prefix of real uv venvs, run by sh and, if present, dash.

A venv counts as installed when make_venv.py's ep-backend.json is in it; a half-built
directory, a temporary build and the `active` symlink are never offered.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from _venv_helpers import SCRIPTS, make_uv_venv

USE_EP = SCRIPTS / "use-ep"
SHELLS = [s for s in ("sh", "dash", "bash") if shutil.which(s)]


@pytest.fixture(scope="module")
def prefix(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """deepep_v1 and deepep_v2 as real (empty) uv venvs; a half-built one; a temp build."""
    root = tmp_path_factory.mktemp("pre fix'q")  # a space and a quote, to test quoting
    for name in ("deepep_v1", "deepep_v2"):
        make_uv_venv(root / name)
        (root / name / "ep-backend.json").write_text(json.dumps({"backend": name}))
    (root / "hybridep" / "bin").mkdir(parents=True)  # no ep-backend.json: not installed
    (root / ".deepep_v1.tmp-abcd").mkdir()
    return root


def use_ep(prefix: Path, *args: str, shell: str = "sh") -> subprocess.CompletedProcess:
    env = {**os.environ, "EP_PREFIX": str(prefix)}
    return subprocess.run([shell, str(USE_EP), *args], capture_output=True, text=True, env=env)


def in_shell(prefix: Path, script: str, shell: str = "sh") -> str:
    env = {**os.environ, "EP_PREFIX": str(prefix), "USE_EP": str(USE_EP)}
    proc = subprocess.run([shell, "-c", script], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("shell", SHELLS)
def test_list_shows_only_complete_venvs(prefix: Path, shell: str) -> None:
    proc = use_ep(prefix, "--list", shell=shell)
    assert proc.returncode == 0
    assert proc.stdout.split() == ["deepep_v1", "deepep_v2"]


@pytest.mark.parametrize("shell", SHELLS)
def test_exports_activate_the_venv(prefix: Path, shell: str) -> None:
    out = in_shell(
        prefix,
        'eval "$(sh "$USE_EP" deepep_v2)"; '
        'printf "%s\\n" "$VIRTUAL_ENV" "$EP_BACKEND" "$PATH"; '
        'python -c "import sys; print(sys.prefix)"',
        shell=shell,
    )
    venv, backend, path, sys_prefix = out.splitlines()
    assert venv == str(prefix / "deepep_v2") == sys_prefix
    assert backend == "deepep_v2"
    assert path.split(":")[0] == f"{prefix}/deepep_v2/bin"


def test_switching_twice_does_not_stack_path(prefix: Path) -> None:
    out = in_shell(
        prefix,
        'eval "$(sh "$USE_EP" deepep_v1)"; eval "$(sh "$USE_EP" deepep_v2)"; '
        'eval "$(sh "$USE_EP" deepep_v1)"; printf "%s\\n" "$PATH"',
    )
    entries = out.strip().split(":")
    assert entries[0] == f"{prefix}/deepep_v1/bin"
    assert [e for e in entries if e.startswith(str(prefix))] == [entries[0]]
    assert "/usr/bin" in entries, "the rest of PATH is kept"


@pytest.mark.parametrize("name", ["hybridep", "deepep_v3", "active", ".deepep_v1.tmp-abcd", "../x"])
def test_unknown_or_incomplete_backend_exits_2_listing_installed(prefix: Path, name: str) -> None:
    proc = use_ep(prefix, name)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "installed: deepep_v1 deepep_v2" in proc.stderr


def test_activate_repoints_the_symlink_atomically(prefix: Path) -> None:
    for name in ("deepep_v1", "deepep_v2"):
        proc = use_ep(prefix, "--activate", name)
        assert proc.returncode == 0, proc.stderr
        assert os.readlink(prefix / "active") == name, "relative link: the prefix may move"
        assert "export EP_BACKEND='" + name + "'" in proc.stdout
    assert not list(prefix.glob(".active.tmp.*"))
    assert use_ep(prefix, "--list").stdout.split() == ["deepep_v1", "deepep_v2"]
    out = in_shell(prefix, '"$EP_PREFIX/active/bin/python" -c "import sys; print(sys.prefix)"')
    assert out.strip() == str(prefix / "active")  # Python keeps the path it was started by
    assert Path(out.strip()).resolve() == (prefix / "deepep_v2").resolve()


def test_usage_errors(prefix: Path) -> None:
    assert use_ep(prefix).returncode == 2
    assert use_ep(prefix, "--bogus").returncode == 2
    assert use_ep(prefix, "deepep_v1", "extra").returncode == 2
    help_text = use_ep(prefix, "--help")
    assert help_text.returncode == 0 and "EP_PREFIX" in help_text.stdout


def test_empty_prefix_says_how_to_build(tmp_path: Path) -> None:
    proc = use_ep(tmp_path, "deepep_v2")
    assert proc.returncode == 2 and "python3 -m ep_image.build_steps.make_venv" in proc.stderr
    assert use_ep(tmp_path, "--list").stdout == ""
