#!/usr/bin/env python3
"""Prove that Transformer Engine works on the cuDNN actually loaded: built-vs-loaded cuDNN,
fused attention forward and backward, te.Linear (docs/probes.md).

The front door of ``ep_image.probes.check_te``, which holds the implementation: it runs this
checkout's package with whatever python runs this file.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's ep_image first

from ep_image.probes.check_te import main

sys.exit(main())
