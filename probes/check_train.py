#!/usr/bin/env python3
"""Prove that this environment's expert-parallel backend trains: a small MoE model trained on
it, with activation checkpointing and Transformer Engine, against the all-gather fallback
(docs/probes.md). Also under torchrun: ``torchrun --nproc-per-node 8 probes/check_train.py``.

A front door (ep_image/repo/front_doors.py): runs the command of the same name in this checkout's
package, with whatever python runs this file.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's ep_image first

from ep_image.repo.front_doors import enter

enter(__file__)
