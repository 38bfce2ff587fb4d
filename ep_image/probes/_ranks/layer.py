"""The size of the MoE layer a rank probe drives the backend with: the default on each device,
and the limits that the token identity written into every row (check_ep's reference) sets.

Why this module exists: the shape is checked twice, from the flags before any work (the command
line) and once a rank knows whether it got a GPU (the worker, which then fills in that device's
defaults); both apply these rules, without torch.
"""

from __future__ import annotations

from ep_image.cli import UsageError
from ep_image.probes._ranks.types import RunOptions

#: Default layer shape: a DeepSeek-V3-like MoE layer on GPU, a small one on CPU.
GPU_DEFAULTS = {"tokens": 4096, "hidden": 7168, "experts": 256, "topk": 8}
CPU_DEFAULTS = {"tokens": 256, "hidden": 512, "experts": 32, "topk": 4}

#: Every token row carries its origin in its first columns (rank, index // 256, index % 256),
#: exact in bf16 (``reference/inputs.py``).
ID_COLUMNS = 3
ID_BASE = 256
MAX_TOKENS = ID_BASE * ID_BASE  # token index must fit two base-256 digits
MAX_RANKS = ID_BASE  # rank id must be exact in bf16
MIN_HIDDEN = 8


def validate_shape(
    tokens: int | None, hidden: int | None, experts: int | None, topk: int | None, world: int
) -> None:
    """The layer shape must be routable: top-k <= experts, experts split evenly over ranks."""
    if topk is not None and experts is not None and topk > experts:
        raise UsageError(f"--topk {topk} is larger than --experts {experts}")
    if experts is not None and experts % world != 0:
        raise UsageError(
            f"--experts {experts} is not divisible by the world size {world}: every rank "
            "must own the same number of experts"
        )
    if tokens is not None and tokens > MAX_TOKENS:
        raise UsageError(f"--tokens {tokens} is above the probe's limit of {MAX_TOKENS} per rank")
    if hidden is not None and hidden < MIN_HIDDEN:
        raise UsageError(
            f"--hidden {hidden} is too small: the probe needs at least {MIN_HIDDEN} columns"
        )
    if world > MAX_RANKS:
        raise UsageError(f"world size {world} is above the probe's limit of {MAX_RANKS} ranks")


def layer_sizes(
    options: RunOptions,
    on_gpu: bool,
    world: int,
    gpu_defaults: dict[str, int] = GPU_DEFAULTS,
    cpu_defaults: dict[str, int] = CPU_DEFAULTS,
) -> dict[str, int]:
    """The flags' sizes, each one not given taken from the device's defaults, checked."""
    defaults = gpu_defaults if on_gpu else cpu_defaults
    given = {
        "tokens": options.tokens,
        "hidden": options.hidden,
        "experts": options.experts,
        "topk": options.topk,
    }
    sizes = {k: given[k] if given[k] is not None else v for k, v in defaults.items()}
    if given["experts"] is None and sizes["experts"] % world != 0:
        device = "GPU" if on_gpu else "CPU"
        raise UsageError(
            f"the {device} layer's {sizes['experts']} experts (the default) do not split evenly "
            f"over {world} ranks: pass --experts N, a multiple of {world}, or start fewer ranks"
        )
    validate_shape(sizes["tokens"], sizes["hidden"], sizes["experts"], sizes["topk"], world)
    return sizes
