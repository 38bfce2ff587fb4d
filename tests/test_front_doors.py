"""Every front door runs the command of its name, and that command has an entry point of its name.

Why these tests: a newcomer finds a command by its name in three places (the door in probes/ or
scripts/, the module in the package, the entry point in a venv's bin/); a door pointing at
another module, or an entry point named otherwise, is a second name to learn. Each door runs
for real (``--help``) and its usage names it.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from ep_image.repo.front_doors import command_of

ROOT = Path(__file__).resolve().parents[1]
DOORS = sorted([*ROOT.joinpath("probes").glob("*.py"), *ROOT.joinpath("scripts").glob("*.py")])
#: Doors whose command has no entry point: bootstrap runs before any venv exists.
NO_ENTRY_POINT = {"bootstrap"}


def entry_points() -> dict[str, str]:
    with (ROOT / "pyproject.toml").open("rb") as fh:
        return tomllib.load(fh)["project"]["scripts"]


@pytest.mark.parametrize("door", DOORS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_door_runs_the_command_of_its_name(door: Path) -> None:
    module = command_of(door)
    assert (ROOT / (module.replace(".", "/") + ".py")).is_file() or (
        ROOT / module.replace(".", "/") / "__init__.py"
    ).is_file(), module
    # The door's whole text is the shared hand-over: no second copy of the logic.
    assert (
        door.read_text()
        .rstrip()
        .endswith("from ep_image.repo.front_doors import enter\n\nenter(__file__)")
    )
    proc = subprocess.run(
        [sys.executable, str(door), "--help"], capture_output=True, text=True, timeout=120, cwd="/"
    )
    assert proc.returncode == 0, proc.stderr
    usage = proc.stdout.splitlines()[0]
    assert usage.startswith("usage: "), usage
    name = door.stem
    assert name in usage.replace("-", "_"), (door, usage)
    if name not in NO_ENTRY_POINT:
        target = entry_points()[name.replace("_", "-")]
        assert target == f"{module}:main", (name, target)


def test_every_command_of_the_package_has_a_door_or_says_why_not() -> None:
    doors = {command_of(d) for d in DOORS}
    commands = {t.partition(":")[0] for t in entry_points().values()}
    # Commands a user runs inside a venv or the image only (no checkout door).
    without = {"ep_image.build_steps.check_installed", "ep_image.backends.__main__"}
    assert commands - doors == without, commands - doors
