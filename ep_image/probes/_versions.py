"""Version strings compared by their leading numbers (``"9.24.0.43"``, ``"2.30.4"``), where a
report holds versions that are not PEP 440 (a library's, a wheel's local build)."""

from __future__ import annotations

import re


def parse_version_triplet(text: str | None) -> tuple[int, int, int] | None:
    """``"9.24.0.43"`` or ``"9.20"`` as (9, 24, 0) / (9, 20, 0); None if it has no numbers."""
    if not text:
        return None
    nums = [int(n) for n in re.findall(r"\d+", str(text))[:3]]
    if not nums:
        return None
    while len(nums) < 3:
        nums.append(0)
    return nums[0], nums[1], nums[2]


def version_at_least(version: str | None, minimum: tuple[int, ...]) -> bool | None:
    """``version >= minimum`` comparing leading integers; None when ``version`` is unknown."""
    if not version:
        return None
    nums = tuple(int(n) for n in re.findall(r"\d+", version)[: len(minimum)])
    if not nums:
        return None
    return nums >= minimum
