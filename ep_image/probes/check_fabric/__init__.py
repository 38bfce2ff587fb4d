"""check_fabric: can this node take part in internode expert parallelism, and if not, why?

Reads each link internode EP needs (RDMA ports, verbs, GPUDirect RDMA, IBGDA, NCCL's network,
the backend's build, GPU-NIC affinity) without torch or a GPU, so a broken one is named with its
fix before a backend fails late and obscurely. One package: the command (``cli``), the node's
facts (``fabric``) and the backend's internode build (``internode``). See docs/probes.md,
section "check-fabric".
"""

from __future__ import annotations

from ep_image.probes.check_fabric.cli import STEP_NAMES, main

__all__ = ["STEP_NAMES", "main"]
