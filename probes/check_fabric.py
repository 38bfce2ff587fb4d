#!/usr/bin/env python3
"""What internode expert parallelism needs on this node: RDMA devices, GPUDirect RDMA,
NVSHMEM IBGDA, NCCL's network plugin (docs/probes.md).

The front door of ``ep_image.probes.check_fabric``, which holds the implementation: it runs this
checkout's package with whatever python runs this file.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's ep_image first

from ep_image.probes.check_fabric import main

sys.exit(main())
