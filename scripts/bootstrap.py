#!/usr/bin/env python3
"""The pinned uv (and, with --tests, the test tools) on a machine with only Python
(README.md).

A front door (ep_image/repo/front_doors.py): runs the command of the same name in this checkout's
package, with whatever python runs this file.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's ep_image first

from ep_image.repo.front_doors import enter

enter(__file__)
