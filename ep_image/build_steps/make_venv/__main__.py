"""``python -m ep_image.build_steps.make_venv``: what the ``make-venv`` command runs."""

from __future__ import annotations

import sys

from ep_image.build_steps.make_venv.cli import main

sys.exit(main())
