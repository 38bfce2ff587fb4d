"""README's commands, .ci/run and bootstrap.py agree, and the pinned uv is one version.

Why: a newcomer runs README's two commands on a fresh machine; CI runs .ci/run. If the two
drift, CI proves something the newcomer never runs. The uv version is written in
ep_image/build_steps/_uv/pinned.py and repeated where Python cannot be imported (.ci/run, ci.yml,
the Dockerfile, README): these tests hold the copies equal.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from ep_image.build_steps import bootstrap
from ep_image.build_steps._uv import pinned

ROOT = Path(__file__).resolve().parents[1]


#: The front door README and .ci/run call (it runs ep_image.build_steps.bootstrap).
BOOTSTRAP = str(ROOT / "scripts" / "bootstrap.py")


def readme_command(label: str) -> str:
    """The first line of the fenced block after README's bold ``label``."""
    text = (ROOT / "README.md").read_text()
    after = text.split(f"**{label}**", 1)[1]
    return after.split("```sh\n", 1)[1].split("\n", 1)[0]


def test_ci_run_runs_readmes_test_command() -> None:
    command = readme_command("The tests")
    assert command.startswith("python3 scripts/bootstrap.py --tests -- uv run")
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert any(line.startswith(command + " ") or line == command for line in lines), (
        f".ci/run does not run README's test command: {command}"
    )


def test_one_uv_version_everywhere() -> None:
    run = re.search(r"^UV_VERSION=(\S+)$", (ROOT / ".ci" / "run").read_text(), re.M)
    assert run and run.group(1) == pinned.UV_VERSION
    assert f"ARG UV_VERSION={pinned.UV_VERSION}\n" in (ROOT / "docker" / "Dockerfile").read_text()
    assert f'UV_VERSION: "{pinned.UV_VERSION}"' in (ROOT / ".github/workflows/ci.yml").read_text()
    readme = (ROOT / "README.md").read_text()
    assert f"uv {pinned.UV_VERSION}" in readme


def test_bootstrap_runs_the_command_with_the_pinned_uv(tmp_path: Path) -> None:
    """With the pinned uv on PATH nothing is downloaded; the command's exit code comes back."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    check = (
        "import subprocess, sys; "
        "print(subprocess.check_output(['uv', '--version'], text=True)); sys.exit(3)"
    )
    proc = subprocess.run(
        [sys.executable, BOOTSTRAP, "--", sys.executable, "-c", check],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    assert f"uv {pinned.UV_VERSION}" in proc.stdout
    assert f"uv {pinned.UV_VERSION}" in proc.stderr  # it says which uv it uses


def test_bootstrap_help_reads_like_documentation() -> None:
    proc = subprocess.run([sys.executable, BOOTSTRAP, "--help"], capture_output=True,
                          text=True, check=True)  # fmt: skip
    for text in ("--tests", pinned.UV_VERSION, "buildah", "debootstrap", "COMMAND"):
        assert text in proc.stdout, text


def packages_named(text: str) -> set[str]:
    """The package list of the sentence in ``text`` that names buildah and debootstrap
    ("buildah, debootstrap, git, gcc and libibverbs-dev")."""
    match = re.search(r"buildah, debootstrap,[^.;()]*?\band\s+([\w.+-]+)", text)
    assert match, "no list of the test packages"
    items = re.split(r",\s*|\s+and\s+", match.group(0))
    return {item.strip() for item in items if item.strip()}


def test_the_docs_name_the_packages_bootstrap_installs() -> None:
    """README and docs/ci.md list what `bootstrap.py --tests` installs: its own list, so the
    two pages cannot drift from it or from each other."""
    wanted = {package for _, package in bootstrap.TEST_PACKAGES}
    for page in ("README.md", "docs/ci.md"):
        named = packages_named(" ".join((ROOT / page).read_text().split()))
        assert named == wanted, f"{page} names {sorted(named)}, bootstrap installs {sorted(wanted)}"


def test_docs_ci_names_each_test_that_skips_without_a_deepep_clone() -> None:
    """Which tests skip on a machine without GitHub: each one whose skip names
    EP_DEEPEP_GIT_DIR is named in docs/ci.md."""
    ci_md = (ROOT / "docs" / "ci.md").read_text()
    skipping = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        blocks = re.split(r"\n(?=(?:@pytest\.mark\.\w+.*\n)*def test_)", path.read_text())
        for block in blocks:
            name = re.search(r"def (test_\w+)", block)
            if name and re.search(r"pytest\.skip\([^)]*EP_DEEPEP_GIT_DIR", block):
                skipping.append(name.group(1))
    assert len(skipping) >= 2, skipping
    missing = [name for name in skipping if f"`{name}`" not in ci_md]
    assert not missing, f"docs/ci.md does not name these skips: {missing}"
