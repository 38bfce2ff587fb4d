"""How the suite is split across pytest-xdist's workers (pyproject.toml: ``-n``, loadgroup).

Why: most of the suite waits (ranks on each other, timeouts, downloads) and left a 2-core CI
machine's second core idle about half the time; run serially it took 30 minutes. Each test
module stays whole on one worker, so its module fixtures (a venv, a dockerd, a buildah storage)
are made once. The image builds (buildah and Docker) share one group, run one after the other
and first: each takes minutes of both cores and gigabytes of disk, so two at once would double
the disk peak, and started last they would be the run's tail. Loaded by conftest.py.
"""

from __future__ import annotations

import pytest

#: Modules that build images: one group, scheduled before everything else.
IMAGE_MODULES = ("test_image_build.py", "test_image_docker.py")
IMAGE_GROUP = "image-builds"


def group_of(item: pytest.Item) -> str:
    """The xdist group of ``item``: the image group, else its own module."""
    module = item.path.name
    return IMAGE_GROUP if module in IMAGE_MODULES else module


@pytest.hookimpl(tryfirst=True)  # before xdist appends the group to each test's id
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group_of(item)))
    # Stable: the image group first, every module's own order kept.
    items.sort(key=lambda item: group_of(item) != IMAGE_GROUP)
