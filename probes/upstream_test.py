#!/usr/bin/env python3
"""A backend's own upstream test, run as the oracle beside check_ep (docs/probes.md).

The front door of ``ep_image.probes.upstream_test``, which holds the implementation: it runs this
checkout's package with whatever python runs this file.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's ep_image first

from ep_image.probes.upstream_test import main

sys.exit(main())
