"""``python -m ep_image.build_steps.dedup``: what the ``dedup`` command runs."""

from __future__ import annotations

import sys

from ep_image.build_steps.dedup.cli import main

sys.exit(main())
