"""``python -m ep_image.build_steps.build_te``: what the ``build-te`` command runs."""

from __future__ import annotations

import sys

from ep_image.build_steps.build_te.cli import main

sys.exit(main())
