"""How the suite is split across pytest-xdist's workers (pyproject.toml's ``-n``).

Why: most of the suite waits (ranks on each other, timeouts, downloads) and left a 2-core CI
machine's second core idle about half the time; run serially it took 30 minutes. Each test
module stays whole on one worker, so its module fixtures (a venv, a dockerd, a buildah storage)
are made once. The image builds (buildah and Docker) are one unit, run one after the other and
first: each takes minutes of both cores and gigabytes of disk, so two at once would double the
disk peak, and started last they would be the run's tail. Loaded by conftest.py.

The split is a scheduler of its own rather than xdist's ``loadgroup``: with pytest 9.2,
xdist 3.8 can no longer rename a test to add its group, and every test became its own unit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

#: Modules that build images: one unit, scheduled before everything else.
IMAGE_MODULES = ("test_image_build.py", "test_image_docker.py")
IMAGE_UNIT = "image builds"


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: the image builds, else its own module."""
    module = nodeid.split("::", 1)[0]
    return IMAGE_UNIT if Path(module).name in IMAGE_MODULES else module


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The image builds first (xdist hands units out in this order); each module's own order
    kept (a stable sort)."""
    items.sort(key=lambda item: unit_of(item.nodeid) != IMAGE_UNIT)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        """xdist's module-at-a-time scheduling, the image modules one unit."""

        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return ByModule(config, log)
