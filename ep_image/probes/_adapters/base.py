"""The expert-parallel backend interface the probes drive: :class:`EPBackend`, and what it
speaks in (the layer's :class:`Shape`, the rows of :class:`Dispatched`, the input classes).

Why this module exists: DeepEP v1 (``deep_ep.Buffer``), DeepEP v2 (``deep_ep.ElasticBuffer``),
HybridEP (``deep_ep.HybridEPBuffer``) and NCCL EP (``nccl.ep.Group``) do the same job - send
each token to the ranks that own its top-k experts (dispatch) and sum the experts' outputs back
(combine) - through four different APIs. ``check_ep`` checks all of them with one set of
checks and ``check_train`` trains on them with one exchange, so each API is wrapped behind this
interface, one adapter a module beside it, and a plain-torch reference backend
(``torch_reference.TorchBackend``, all_gather based, like the slow fallback MoE code uses
without DeepEP) lets every check run in CI over gloo on CPUs.

The contract every adapter follows (DeepEP's "normal" non-expanded layout):

- ``dispatch(x, topk_idx, topk_weights)`` gives each rank one row per token that has at least
  one of its top-k experts on that rank (a token is sent once per rank, not once per expert),
  in any order, with ``recv_topk_idx`` holding *local* expert indices (``-1`` for top-k slots
  whose expert lives on another rank) and the matching weights, plus the received-token count
  per local expert.
- ``combine(y, handle)`` sends row ``i`` of ``y`` back to the token it came from and sums the
  rows of each token over ranks, *without* weights (the expert side applies them).
- ``dispatch_backward`` / ``combine_backward`` are the gradients of the two: the gradient of a
  copy-to-ranks is a sum-over-ranks (a combine), and the gradient of a sum-over-ranks is a
  copy-to-ranks along the same layout (a dispatch that reuses the handle).
- ``dispatch_backward_with_weights`` is dispatch's gradient with respect to both things it
  sent: the rows, and the top-k weights (the router's probabilities), whose received slots'
  gradients are summed back per token and slot. Training frameworks carry the router's
  gradient back through the backend's combine this way (DeepEP's ``combine(topk_weights=)``,
  HybridEP's ``combine(probs=)``); ``check_train`` drives it.

Other adapters (tests, new backends) subclass :class:`EPBackend` and are loaded by
``check-ep --backend-class FILE.py:Class`` (``plugins``). This module imports no torch: the
annotations name torch's types only.
"""

from __future__ import annotations

import abc
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ep_image.probes._report import Status

#: A prerequisite that is not met: (status, what is wrong, the fix).
Problem = tuple[Status, str, str]

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

#: Inputs training presents that a backend's API may not take (``EPBackend.input_limits``).
UNEVEN_TOKENS = "uneven_tokens"
DROPPED_SLOTS = "dropped_slots"
INPUT_CLASSES = {
    UNEVEN_TOKENS: "ranks holding different numbers of tokens, 0 included",
    DROPPED_SLOTS: "top-k slots with expert index -1 (dropped or padded)",
}


@dataclasses.dataclass(frozen=True)
class Shape:
    """The MoE layer the probe emulates; buffers are sized from it."""

    tokens: int  # tokens per rank
    hidden: int
    experts: int  # experts over all ranks
    topk: int
    dtype: torch.dtype
    device: torch.device

    def local_experts(self, world_size: int) -> int:
        return self.experts // world_size


@dataclasses.dataclass
class Dispatched:
    """What a rank receives from dispatch (the layout: this module's docstring)."""

    recv_x: torch.Tensor  # [rows, hidden]
    recv_topk_idx: torch.Tensor  # [rows, k] local expert index or -1
    recv_topk_weights: torch.Tensor  # [rows, k] float32
    num_recv_per_expert: list[int]  # [local experts]
    handle: Any


class EPBackend(abc.ABC):
    """One expert-parallel communication backend, as the probe drives it.

    Class attributes describe what the backend needs, so the probe can say "skipped: no
    GPU" or "needs 2, 4 or 8 ranks" before touching it.
    """

    #: Name in reports.
    name: ClassVar[str] = "custom"
    #: The module and class it drives (``BackendSpec.module`` and ``.api``: ``deep_ep`` and
    #: ``ElasticBuffer``, ``nccl.ep`` and ``Group``); ``api`` empty for other adapters.
    module: ClassVar[str] = "deep_ep"
    api: ClassVar[str] = ""
    #: Needs CUDA devices (and an NCCL process group).
    requires_gpu: ClassVar[bool] = True
    #: Compiles kernels at run time, so it needs a CUDA home with the tools of ``jit_tools``.
    jit_compiles: ClassVar[bool] = False
    #: The programs its JIT runs from ``$CUDA_HOME/bin`` (checked when ``jit_compiles``): the
    #: prerequisites step fails, naming each one missing, before any buffer is made.
    jit_tools: ClassVar[tuple[str, ...]] = ("nvcc",)
    #: The variable that points its kernel cache elsewhere (``jit_cache_dir``), for the fix
    #: when that cache is not safe to load from.
    jit_cache_variable: ClassVar[str] = "EP_JIT_CACHE_DIR"
    #: Token dtypes dispatch accepts, as torch dtype names.
    dtypes: ClassVar[tuple[str, ...]] = ("bfloat16",)
    #: World sizes the backend supports (None: any).
    world_sizes: ClassVar[tuple[int, ...] | None] = None
    #: Sentence explaining ``world_sizes``, for the skip message.
    world_size_note: ClassVar[str] = ""
    #: Minimum NCCL version, if the backend needs one.
    min_nccl: ClassVar[tuple[int, int] | None] = None
    #: Builds NCCL communicators from the group: cannot run with ranks sharing a GPU.
    needs_nccl_group: ClassVar[bool] = False
    #: Input classes (keys of ``INPUT_CLASSES``) the backend's documented API does not
    #: take, each with the reason; check_ep reports the scenarios that need one as "not
    #: applicable to <backend>: <reason>" instead of running them.
    input_limits: ClassVar[dict[str, str]] = {}

    def load(self) -> dict[str, Any]:
        """Import what the backend needs; return facts for the report (module path...)."""
        return {}

    def jit_cache_dir(self) -> Path | None:
        """Where the backend loads compiled kernels from across processes, if anywhere: such a
        directory must be writable by nobody but this user or root (``_ranks/gates.py`` checks
        it)."""
        return None

    def prerequisites(self) -> tuple[dict[str, Any], list[Problem]]:
        """What this backend needs beyond the checks every backend gets (GPU, world size, CUDA
        home and JIT tools, NCCL version, JIT cache), checked after ``load`` and before any
        buffer is made: facts for the report, and each unmet need with its fix."""
        return {}, []

    def unsupported(self, world: int, local_world: int) -> str | None:
        """Why it cannot run on ``world`` ranks, ``local_world`` per node (None: it can)."""
        if self.world_sizes is not None and world not in self.world_sizes:
            return self.world_size_note or f"run with {self.world_sizes} ranks"
        return None

    @abc.abstractmethod
    def create(self, group: dist.ProcessGroup, shape: Shape) -> None:
        """Build the communication buffer for ``shape`` on the EP process ``group``."""

    @abc.abstractmethod
    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> Dispatched:
        """Send each token to the ranks that own its experts."""

    @abc.abstractmethod
    def combine(self, y: torch.Tensor, handle: Any) -> torch.Tensor:
        """Sum the rows of ``y`` back onto the tokens they came from: ``[tokens, hidden]``."""

    @abc.abstractmethod
    def dispatch_cached(self, x: torch.Tensor, handle: Any) -> torch.Tensor:
        """Dispatch ``x`` along the layout of an earlier dispatch (no routing given)."""

    def dispatch_backward(self, grad_recv_x: torch.Tensor, handle: Any) -> torch.Tensor:
        """Gradient of dispatch: the received rows' gradients summed back per token."""
        return self.combine(grad_recv_x, handle)

    def combine_backward(self, grad_out: torch.Tensor, handle: Any) -> torch.Tensor:
        """Gradient of combine: each token's output gradient copied to every row it came from."""
        return self.dispatch_cached(grad_out, handle)

    def dispatch_backward_with_weights(
        self, grad_recv_x: torch.Tensor, grad_recv_topk_weights: torch.Tensor, handle: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradient of dispatch w.r.t. the rows and the top-k weights it sent: the received
        rows' gradients summed back per token (``[tokens, hidden]``, as ``dispatch_backward``)
        and the received weights' gradients summed back per token and slot (``[tokens, topk]``
        float32; a slot whose expert is not on a rank gets nothing from that rank)."""
        raise NotImplementedError(
            f"{self.name}'s adapter does not carry the top-k weights' gradient back "
            "(dispatch_backward_with_weights)"
        )

    def destroy(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release the buffer (explicitly, so no destructor runs during interpreter exit)."""

    def facts(self) -> dict[str, Any]:
        """Facts for the buffer step's report, known once ``create`` ran (e.g. a JIT cache)."""
        return {}
