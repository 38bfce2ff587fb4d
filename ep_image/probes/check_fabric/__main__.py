"""``python -m ep_image.probes.check_fabric``: what the ``check-fabric`` command runs."""

from __future__ import annotations

import sys

from ep_image.probes.check_fabric.cli import main

sys.exit(main())
