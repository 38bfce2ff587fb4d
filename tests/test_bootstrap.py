"""bootstrap.py speaks the scaffold's language on a bare Python: bad usage, unreachable PyPI.

Why: bootstrap is the first command a newcomer runs, on a python3 with no venv and nothing
installed; a wrong flag there must be one line and exit 2 like every other command, and a
network that blocks PyPI must end in a fix, not a traceback.
"""

from __future__ import annotations

import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from ep_image.build_steps import bootstrap

ROOT = Path(__file__).resolve().parents[1]
#: The front door README and .ci/run call.
BOOTSTRAP = str(ROOT / "scripts" / "bootstrap.py")


def bare_bootstrap(*args: str) -> subprocess.CompletedProcess[str]:
    """The front door under ``python -S``: no site-packages, so only the standard library and
    this checkout's ep_image can be imported, as on a machine with nothing installed."""
    return subprocess.run(
        [sys.executable, "-S", BOOTSTRAP, *args], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    ("args", "phrase"),
    [
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--shell", "--", "true"], "--shell prints a line for eval; it runs no COMMAND"),
    ],
)
def test_bad_usage_is_one_line_and_exit_2_before_any_work(args: list[str], phrase: str) -> None:
    proc = bare_bootstrap(*args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines == [f"bootstrap: usage error: {phrase} (see --help)"], proc.stderr
    assert proc.stdout == ""


def test_help_runs_on_the_standard_library_alone() -> None:
    proc = bare_bootstrap("--help")
    assert proc.returncode == 0, proc.stderr
    assert "python3 scripts/bootstrap.py [--tests]" in proc.stdout


def test_unreachable_pypi_names_the_fix(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No pinned uv anywhere and PyPI refused: exit 1, the cause and the fix, no traceback."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(bootstrap, "uv_version", lambda uv: None)

    def refused(*args: object, **kwargs: object) -> None:
        raise urllib.error.URLError(ConnectionRefusedError(111, "Connection refused"))

    monkeypatch.setattr(urllib.request, "urlopen", refused)
    assert bootstrap.main([]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-2].startswith(f"bootstrap: error: cannot download uv {bootstrap.UV_VERSION} ")
    assert "Connection refused" in err[-2]
    assert err[-1].startswith("bootstrap: fix: set HTTPS_PROXY")
    assert f"install uv {bootstrap.UV_VERSION} another way" in err[-1]
