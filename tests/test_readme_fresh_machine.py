"""README's "On a fresh machine", read as a new user reads it: what its commands do is said.

Why: the section is the first thing a newcomer runs. Each test ties a statement there to the
fact it describes (the command line, pytest's configuration, the image tests' cache), so the
text cannot drift from what the commands do. tests/test_ci.py holds the commands themselves
equal to .ci/run.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def fresh_machine() -> str:
    text = README.read_text()
    return text.split("## On a fresh machine", 1)[1].split("\n## ", 1)[0]


def first_command_after(label: str) -> str:
    after = fresh_machine().split(f"**{label}**", 1)[1]
    return after.split("```sh\n", 1)[1].split("\n", 1)[0]


def test_the_main_job_says_where_its_report_goes() -> None:
    command = first_command_after("The main job")
    found = re.search(r"--json (\S+)", command)
    assert found, command
    prose = fresh_machine().split(command, 1)[1].split("**The tests**", 1)[0]
    assert f"report to `{found[1]}`" in prose, "the reader is not told where the report is"


def test_torchrun_is_the_venvs_own() -> None:
    """A bare `torchrun` is not on PATH after the main job: it lives in the venv's bin/."""
    section = fresh_machine()
    calls = re.findall(r"(\S*torchrun) --nproc-per-node", section)
    assert calls, "no multi-rank command shown"
    for call in calls:
        assert re.fullmatch(r"`?venvs/\w+/bin/torchrun", call), call
    assert "bin/check-ep --nproc-per-node" in section
    cli = ROOT / "ep_image" / "probes" / "check_ep" / "cli.py"
    assert '"--nproc-per-node"' in cli.read_text()


def _shows_skip_reasons(args: str) -> bool:
    return any(re.fullmatch(r"-r\w*[sa]\w*|-rA", arg) for arg in args.split())


def test_skip_reasons_are_shown_or_the_readme_says_how() -> None:
    command = first_command_after("The tests")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    addopts = config["tool"]["pytest"]["ini_options"].get("addopts", "")
    if isinstance(addopts, list):
        addopts = " ".join(addopts)
    if _shows_skip_reasons(command) or _shows_skip_reasons(addopts):
        return
    assert "add `-rs` to the command" in " ".join(fresh_machine().split()), (
        "README implies skip reasons are listed, but its command does not list them"
    )


def test_the_cache_the_tests_leave_is_named_with_how_to_remove_it() -> None:
    source = (ROOT / "tests" / "_buildah.py").read_text()
    default = re.search(r'"EP_IMAGE_TEST_CACHE", "([^"]+)"', source)
    assert default, "the image tests' cache default moved"
    section = " ".join(fresh_machine().split())
    assert f"`rm -rf {default[1]}`" in section
    assert "2.5 GB" in section


def _minutes_of_measured_runs(page: Path) -> list[float]:
    """The wall time, in minutes, of every run of the suite the results page lists on overlay
    storage with warm caches (the conditions README's figure is for)."""
    rows = [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in page.read_text().splitlines()
        if line.startswith("|")
    ]
    header = next(row for row in rows if "wall time" in row)
    storage, caches, wall = (
        header.index(name) for name in ("image tests' storage", "caches", "wall time")
    )
    minutes = []
    for row in rows:
        if len(row) == len(header) and row[storage] == "overlay" and row[caches] == "warm":
            found = re.search(r"(\d+(?:\.\d+)?) min", row[wall])
            assert found, row
            minutes.append(float(found[1]))
    return minutes


def test_the_suite_time_covers_every_measured_run() -> None:
    """README's range for the whole suite reaches every run measured under its conditions, on
    the results page it links for them (loaded machine included)."""
    section = " ".join(fresh_machine().split())
    found = re.search(r"whole suite took (\d+(?:\.\d+)?)-(\d+(?:\.\d+)?) minutes", section)
    assert found, "no time for the suite"
    link = re.search(r"\]\((docs/results/[^)#]+)", section[found.end() :])
    assert link, "the suite's time links no results page"
    minutes = _minutes_of_measured_runs(ROOT / link[1])
    assert minutes, f"{link[1]} lists no run on overlay with warm caches"
    low, high = float(found[1]), float(found[2])
    assert low <= min(minutes) and high >= max(minutes), (low, high, sorted(minutes))
