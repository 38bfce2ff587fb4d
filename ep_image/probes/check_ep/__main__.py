"""``python -m ep_image.probes.check_ep`` and ``torchrun -m ep_image.probes.check_ep``: what the
``check-ep`` command runs, and what every rank of ``--nproc-per-node`` runs."""

from __future__ import annotations

import sys

from ep_image.probes.check_ep.cli import main

sys.exit(main())
