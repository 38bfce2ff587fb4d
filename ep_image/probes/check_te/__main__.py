"""``python -m ep_image.probes.check_te``: what the ``check-te`` command runs."""

from __future__ import annotations

import sys

from ep_image.probes.check_te.cli import main

sys.exit(main())
