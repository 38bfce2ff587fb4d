#!/usr/bin/env python3
"""One EP backend's venv under a prefix, from the committed uv.lock, atomically
(docs/host-mode.md).

The front door of ``ep_image.build_steps.make_venv``, which holds the implementation: it runs this
checkout's package with whatever python runs this file.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's ep_image first

from ep_image.build_steps.make_venv import main

sys.exit(main())
