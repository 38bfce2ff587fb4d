#!/usr/bin/env python3
"""Host mode: every requested backend's venv under a prefix, deduplicated, one made active
(docs/host-mode.md).

The front door of ``ep_image.build_steps.host``, which holds the implementation: it runs this
checkout's package with whatever python runs this file.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's ep_image first

from ep_image.build_steps.host import main

sys.exit(main())
