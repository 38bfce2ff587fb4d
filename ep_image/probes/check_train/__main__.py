"""``python -m ep_image.probes.check_train`` and ``torchrun -m ep_image.probes.check_train``:
what the ``check-train`` command runs, and what every rank of ``--nproc-per-node`` runs."""

from __future__ import annotations

import sys

from ep_image.probes.check_train.cli import main

sys.exit(main())
