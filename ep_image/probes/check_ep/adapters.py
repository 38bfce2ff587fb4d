"""The expert-parallel backend interface the probe checks, and one adapter per backend.

Why this module exists: DeepEP v1 (``deep_ep.Buffer``), DeepEP v2 (``deep_ep.ElasticBuffer``)
and HybridEP (``deep_ep.HybridEPBuffer``) do the same job - send each token to the ranks
that own its top-k experts (dispatch) and sum the experts' outputs back (combine) - through
three different APIs. ``check_ep`` tests all of them with one set of checks, so each API is
wrapped here behind :class:`EPBackend`, and a plain-torch reference backend
(:class:`TorchBackend`, all_gather based, like the slow fallback MoE code uses without DeepEP)
lets every check run in CI over gloo on CPUs.

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

Other adapters (tests, new backends) subclass :class:`EPBackend` and are loaded by
``check_ep.py --backend-class FILE.py:Class``.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
import importlib.util
import os
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from ep_image.probes._backend_detect import registry
from ep_image.probes._report import UsageError
from ep_image.probes.check_ep.scenarios import DROPPED_SLOTS, INPUT_CLASSES, UNEVEN_TOKENS  # noqa: F401


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
    """What a rank receives from dispatch (see the module docstring for the layout)."""

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
    #: The ``deep_ep`` buffer class it drives (``BackendSpec.api``); empty for other adapters.
    api: ClassVar[str] = ""
    #: Needs CUDA devices (and an NCCL process group).
    requires_gpu: ClassVar[bool] = True
    #: Compiles kernels at run time, so it needs a CUDA home with nvcc.
    jit_compiles: ClassVar[bool] = False
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

    def destroy(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release the buffer (explicitly, so no destructor runs during interpreter exit)."""

    def facts(self) -> dict[str, Any]:
        """Facts for the buffer step's report, known once ``create`` ran (e.g. a JIT cache)."""
        return {}


# --------------------------------------------------------------------------------------
# Reference backend: plain torch.distributed, CPU (gloo) or GPU (NCCL).
# --------------------------------------------------------------------------------------


def all_gather_rows(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate ``t`` (same shape on every rank) from all ranks along dim 0."""
    world = dist.get_world_size(group)
    out = t.new_empty((world * t.shape[0], *t.shape[1:]))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, t.contiguous(), group=group)
    return out


@dataclasses.dataclass
class TorchHandle:
    """Where each received row came from, as rows of the padded all-gathered token list."""

    rows: torch.Tensor  # index into [world * max_tokens]
    max_tokens: int
    tokens: int  # this rank's token count


class TorchBackend(EPBackend):
    """All-gather dispatch and all-reduce combine: slow, obviously correct, runs anywhere.

    This is what MoE code falls back to without DeepEP (a token-count all_gather, padded
    all_gathers of tokens and routing, an all-reduce to combine). The probe uses it to
    exercise every check on a real multi-process group in CI.
    """

    name = "torch"
    requires_gpu = False
    dtypes = ("float32", "bfloat16", "float16")

    def create(self, group: dist.ProcessGroup, shape: Shape) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.shape = shape
        self.local = shape.local_experts(self.world)

    def _gather_padded(self, t: torch.Tensor, max_tokens: int) -> torch.Tensor:
        padded = t.new_zeros((max_tokens, *t.shape[1:]))
        padded[: t.shape[0]] = t
        return all_gather_rows(padded, self.group)

    def _max_tokens(self, tokens: int, device: torch.device) -> int:
        count = torch.tensor([tokens], dtype=torch.int64, device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.group)
        return max(int(count.item()), 1)  # a padding row when no rank holds a token

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> Dispatched:
        tokens = x.shape[0]
        max_tokens = self._max_tokens(tokens, x.device)
        g_x = self._gather_padded(x, max_tokens)
        # Padding rows route nowhere (-1), so they are never received.
        idx = torch.full((max_tokens, topk_idx.shape[1]), -1, dtype=torch.int64, device=x.device)
        idx[:tokens] = topk_idx.to(torch.int64)
        g_idx = all_gather_rows(idx, self.group)
        g_w = self._gather_padded(topk_weights.float(), max_tokens)

        lo = self.rank * self.local
        mine = (g_idx >= lo) & (g_idx < lo + self.local)
        rows = mine.any(dim=1).nonzero().squeeze(1)
        recv_idx = torch.where(mine[rows], g_idx[rows] - lo, torch.full_like(g_idx[rows], -1))
        counts = torch.bincount(recv_idx[recv_idx >= 0], minlength=self.local)
        return Dispatched(
            recv_x=g_x[rows],
            recv_topk_idx=recv_idx,
            recv_topk_weights=g_w[rows],
            num_recv_per_expert=[int(c) for c in counts.tolist()],
            handle=TorchHandle(rows=rows, max_tokens=max_tokens, tokens=tokens),
        )

    def combine(self, y: torch.Tensor, handle: TorchHandle) -> torch.Tensor:
        full = torch.zeros(
            (self.world * handle.max_tokens, y.shape[1]), dtype=torch.float32, device=y.device
        )
        full.index_add_(0, handle.rows, y.float())
        dist.all_reduce(full, group=self.group)
        start = self.rank * handle.max_tokens
        return full[start : start + handle.tokens].to(y.dtype)

    def dispatch_cached(self, x: torch.Tensor, handle: TorchHandle) -> torch.Tensor:
        return self._gather_padded(x, handle.max_tokens)[handle.rows]


# --------------------------------------------------------------------------------------
# DeepEP adapters. Written against DeepEP's public Python APIs:
#   v1: deep_ep/buffer.py at 567632dd (tokenspeed-deepep 1.2.1 ships the same file)
#   v2: deep_ep/buffers/elastic.py at af9a0403 and sgl-deep-ep 0.1.2.post1
#   HybridEP: deep_ep/hybrid_ep_buffer.py at e0a5b1d9 (hybrid-ep branch)
# --------------------------------------------------------------------------------------


def _import_deep_ep() -> Any:
    return importlib.import_module("deep_ep")


def _module_facts(deep_ep: Any) -> dict[str, Any]:
    return {
        "module_path": getattr(deep_ep, "__file__", None),
        "module_version": getattr(deep_ep, "__version__", None),
    }


def jit_cache_facts(env: dict[str, str] | None = None) -> dict[str, Any]:
    """DeepEP v2's JIT cache before this run: where (EP_JIT_CACHE_DIR, else ~/.deep_ep), how
    many kernels it holds. An empty one means minutes of compiling at first dispatch; a
    container that keeps it (a volume, the image's EP_JIT_CACHE_DIR) pays that once."""
    env = dict(os.environ if env is None else env)
    home = env.get("HOME") or os.path.expanduser("~")
    where = env.get("EP_JIT_CACHE_DIR") or os.path.join(home, ".deep_ep")
    files, size = 0, 0
    for root, _dirs, names in os.walk(where):
        for name in names:
            try:
                size += os.lstat(os.path.join(root, name)).st_size
                files += 1
            except OSError:
                continue
    gin_off = env.get("EP_DISABLE_GIN", "0") not in ("", "0")
    return {
        "jit_cache_dir": where,
        "jit_cache_from": "EP_JIT_CACHE_DIR" if env.get("EP_JIT_CACHE_DIR") else "default",
        "jit_cache_files_before": files,
        "jit_cache_bytes_before": size,
        "gin": "disabled (EP_DISABLE_GIN=1: NVLink only, one node)" if gin_off else "enabled",
    }


class DeepEPv1Backend(EPBackend):
    """DeepEP v1 ``deep_ep.Buffer``, normal kernels: intranode (NVLink) on one node, internode
    (NVLink + RDMA through NVSHMEM) when the ranks span nodes.

    The intranode kernels exist for 2, 4 and 8 ranks only; across nodes DeepEP needs 8 ranks
    per node (one NVLink domain of 8 GPUs) and an RDMA buffer, which ``Buffer.dispatch`` then
    uses on its own (``get_num_rdma_ranks() > 1``).
    """

    name = ""  # the backend's, given by adapter_for
    api = "Buffer"
    world_sizes = (2, 4, 8)
    world_size_note = (
        "DeepEP v1 intranode kernels support only 2, 4 or 8 ranks on one NVLink node; "
        "launch with torchrun --nproc-per-node 2, 4 or 8"
    )
    #: Ranks per node DeepEP's internode kernels are built for (NUM_MAX_NVL_PEERS).
    ranks_per_node_internode = 8

    def unsupported(self, world: int, local_world: int) -> str | None:
        if world <= local_world:
            return super().unsupported(world, local_world)
        if local_world != self.ranks_per_node_internode:
            return (
                "DeepEP v1 internode kernels need 8 ranks per node (one per GPU of an 8-GPU "
                f"NVLink node), not {local_world}: launch torchrun --nproc-per-node 8 on every node"
            )
        return None

    def load(self) -> dict[str, Any]:
        self.deep_ep = _import_deep_ep()
        self.Buffer = self.deep_ep.Buffer
        self.topk_idx_t = getattr(self.deep_ep, "topk_idx_t", torch.int64)
        facts = _module_facts(self.deep_ep)
        try:
            facts["sm90_compiled"] = bool(self.Buffer.is_sm90_compiled())
        except Exception:
            facts["sm90_compiled"] = None
        return facts

    def create(self, group: dist.ProcessGroup, shape: Shape) -> None:
        world = group.size()
        self.shape = shape
        hidden_bytes = shape.hidden * max(torch.tensor([], dtype=shape.dtype).element_size(), 2)
        # The NVLink buffer must hold a dispatch and a combine of this hidden size (the
        # sizing Megatron-style DeepEP dispatchers use).
        num_nvl_bytes = num_rdma_bytes = 0
        internode = world > self.ranks_per_node_internode
        for config in (
            self.Buffer.get_dispatch_config(world),
            self.Buffer.get_combine_config(world),
        ):
            num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, world), num_nvl_bytes)
            if internode:
                hint = config.get_rdma_buffer_size_hint(hidden_bytes, world)
                num_rdma_bytes = max(hint, num_rdma_bytes)
        self.buffer = self.Buffer(group, num_nvl_bytes, num_rdma_bytes, explicitly_destroy=True)
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> Dispatched:
        topk_idx = topk_idx.to(self.topk_idx_t)
        topk_weights = topk_weights.float()
        per_rank, per_rdma_rank, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(
            topk_idx, self.shape.experts
        )
        recv_x, recv_idx, recv_w, counts, handle, _ = self.buffer.dispatch(
            x,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
        )
        return Dispatched(recv_x, recv_idx, recv_w, [int(c) for c in counts], handle)

    def combine(self, y: torch.Tensor, handle: Any) -> torch.Tensor:
        combined, _, _ = self.buffer.combine(y, handle)
        return combined

    def dispatch_cached(self, x: torch.Tensor, handle: Any) -> torch.Tensor:
        recv_x, *_ = self.buffer.dispatch(x, handle=handle)
        return recv_x

    def destroy(self) -> None:
        buffer = getattr(self, "buffer", None)
        if buffer is not None:
            buffer.destroy()
            self.buffer = None


@dataclasses.dataclass
class _RowsHandle:
    """A backend handle plus the number of valid received rows and the padded row count."""

    raw: Any
    rows: int
    padded_rows: int


def _pad_rows(y: torch.Tensor, padded_rows: int) -> torch.Tensor:
    if y.shape[0] == padded_rows:
        return y
    full = y.new_zeros((padded_rows, *y.shape[1:]))
    full[: y.shape[0]] = y
    return full


class DeepEPv2Backend(EPBackend):
    """DeepEP v2 ``deep_ep.ElasticBuffer`` (non-expanded layout, CPU-synced counts).

    Its kernels are JIT-compiled on first use (CUDA home with nvcc needed) and its import
    requires NCCL >= 2.30 (``ncclCommQueryProperties``).
    """

    name = ""  # the backend's, given by adapter_for
    api = "ElasticBuffer"
    jit_compiles = True
    min_nccl = (2, 30)
    needs_nccl_group = True

    def load(self) -> dict[str, Any]:
        self.deep_ep = _import_deep_ep()
        self.ElasticBuffer = self.deep_ep.ElasticBuffer
        self.topk_idx_t = getattr(self.deep_ep, "topk_idx_t", torch.int64)
        return {**_module_facts(self.deep_ep), **jit_cache_facts()}

    def create(self, group: dist.ProcessGroup, shape: Shape) -> None:
        self.shape = shape
        # Sized from the MoE settings (BF16 tokens), as ElasticBuffer computes it.
        self.buffer = self.ElasticBuffer(
            group,
            num_max_tokens_per_rank=shape.tokens,
            hidden=shape.hidden,
            num_topk=shape.topk,
            explicitly_destroy=True,
        )

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> Dispatched:
        recv_x, recv_idx, recv_w, handle, _ = self.buffer.dispatch(
            x,
            topk_idx=topk_idx.to(self.topk_idx_t),
            topk_weights=topk_weights.float(),
            num_experts=self.shape.experts,
            num_max_tokens_per_rank=self.shape.tokens,
        )
        # Received rows may be padded to a buffer size; the prefix sum's last element is
        # the real count (DeepEP's own test reads it the same way).
        rows = int(handle.psum_num_recv_tokens_per_scaleup_rank[-1].item())
        return Dispatched(
            recv_x=recv_x[:rows],
            recv_topk_idx=recv_idx[:rows],
            recv_topk_weights=recv_w[:rows],
            num_recv_per_expert=[int(c) for c in handle.num_recv_tokens_per_expert_list],
            handle=_RowsHandle(handle, rows, recv_x.shape[0]),
        )

    def combine(self, y: torch.Tensor, handle: _RowsHandle) -> torch.Tensor:
        combined, _, _ = self.buffer.combine(_pad_rows(y, handle.padded_rows), handle.raw)
        return combined

    def dispatch_cached(self, x: torch.Tensor, handle: _RowsHandle) -> torch.Tensor:
        # num_experts is passed although the handle holds it: dispatch sizes its SM count
        # from it before it reads the handle.
        recv_x, _, _, _, _ = self.buffer.dispatch(
            x, handle=handle.raw, num_experts=self.shape.experts
        )
        return recv_x[: handle.rows]

    def destroy(self) -> None:
        buffer = getattr(self, "buffer", None)
        if buffer is not None:
            buffer.destroy()
            self.buffer = None


class HybridEPBackend(EPBackend):
    """HybridEP ``deep_ep.HybridEPBuffer`` (NVIDIA's hybrid-ep branch), non-permuted API.

    HybridEP returns a routing map (token x local expert) instead of top-k indices; the
    adapter turns it back into ``recv_topk_idx`` so the same checks apply. It JIT-compiles
    its kernels (CUDA home with nvcc needed).
    """

    name = ""  # the backend's, given by adapter_for
    api = "HybridEPBuffer"
    jit_compiles = True
    input_limits: ClassVar[dict[str, str]] = {
        UNEVEN_TOKENS: "HybridEPBuffer.dispatch takes one token count for every rank (it "
        "all-gathers the routing map as num_of_tokens_per_rank x ranks rows, "
        "Executor::allgather_routing_map at e0a5b1d9), so every rank must pass the same "
        "number of tokens",
    }

    def load(self) -> dict[str, Any]:
        self.deep_ep = _import_deep_ep()
        self.HybridEPBuffer = self.deep_ep.HybridEPBuffer
        return _module_facts(self.deep_ep)

    def create(self, group: dist.ProcessGroup, shape: Shape) -> None:
        from ep_image import hybridep_jit

        self.shape = shape
        self.local = shape.local_experts(group.size())
        # Kernels compiled by earlier processes, from EP_HYBRIDEP_JIT_CACHE: HybridEP itself
        # compiles into a directory of this process's own (ep_image/hybridep_jit.py).
        self.jit = hybridep_jit.prepare(
            arch=torch.cuda.get_device_capability(),
            package_dir=os.path.dirname(self.deep_ep.__file__),
        )
        self._published = False
        self.buffer = self.HybridEPBuffer(
            group=group,
            hidden_dim=shape.hidden,
            max_num_of_tokens_per_rank=shape.tokens,
            num_local_experts=self.local,
            use_fp8=False,
            load_cached_kernels=self.jit.load_cached_kernels,
        )

    def facts(self) -> dict[str, Any]:
        return self.jit.facts() if getattr(self, "jit", None) else {}

    def destroy(self) -> None:
        jit = getattr(self, "jit", None)
        if jit is not None:
            jit.close()  # publishes what backward compiled, removes this process's directory

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> Dispatched:
        route: dict[str, Any] = {
            "topk_idx": topk_idx.to(torch.int64),
            "topk_weights": topk_weights.float(),
        }
        if bool((topk_idx < 0).any()):
            # HybridEP's index API scatters topk_idx into a [tokens, experts] map, where -1 is
            # out of range; a slot that routes nowhere is a False in the routing map, which
            # its dispatch takes directly (the form Megatron passes).
            routing_map, probs = _topk_to_routing_map(topk_idx, topk_weights, self.shape.experts)
            route = {"routing_map": routing_map, "probs": probs}
        recv_x, recv_probs, _, handle = self.buffer.dispatch(
            hidden=x, num_of_experts=self.shape.experts, **route
        )
        # handle = (sparse_to_dense_map, rdma_to_attn_map, attn_to_rdma_map,
        #           num_dispatched_tokens_tensor, local_expert_routing_map, tokens, config)
        rows = int(handle[3].reshape(-1)[0].item())
        routing = handle[4][:rows].bool()  # [rows, local experts]
        # Probs come back for the experts of the whole NVLink domain; this rank's slice
        # starts at local_rank * local_experts.
        start = self.buffer.local_rank * self.local
        local_probs = recv_probs[:rows, start : start + self.local].float()
        recv_idx, recv_w = _routing_map_to_topk(routing, local_probs, self.shape.topk)
        counts = routing.sum(dim=0).tolist()
        return Dispatched(
            recv_x=recv_x[:rows],
            recv_topk_idx=recv_idx,
            recv_topk_weights=recv_w,
            num_recv_per_expert=[int(c) for c in counts],
            handle=_RowsHandle(handle, rows, recv_x.shape[0]),
        )

    def combine(self, y: torch.Tensor, handle: _RowsHandle) -> torch.Tensor:
        combined, _ = self.buffer.combine(
            hidden=_pad_rows(y, handle.padded_rows), probs=None, handle=handle.raw
        )
        if not self._published:  # preprocessing, dispatch and combine kernels exist now
            self.jit.publish()
            self._published = True
        return combined

    def dispatch_cached(self, x: torch.Tensor, handle: _RowsHandle) -> torch.Tensor:
        recv_x, _, _, _ = self.buffer.dispatch(
            hidden=x, num_of_experts=self.shape.experts, handle=handle.raw
        )
        return recv_x[: handle.rows]


def _topk_to_routing_map(
    topk_idx: torch.Tensor, topk_weights: torch.Tensor, experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing (``-1``: no expert) as HybridEP's ``[tokens, experts]`` bool routing map
    and float32 probs, the tensors its ``indices_to_map`` builds from valid indices."""
    idx = topk_idx.to(torch.int64)
    valid = idx >= 0
    # Slots with idx -1 go to a spare last column, dropped at the end.
    slot = torch.where(valid, idx, torch.full_like(idx, experts))
    rows = idx.shape[0]
    routing = torch.zeros((rows, experts + 1), dtype=torch.bool, device=idx.device)
    routing.scatter_(1, slot, True)
    probs = torch.zeros((rows, experts + 1), dtype=torch.float32, device=idx.device)
    weights = torch.where(valid, topk_weights.float(), torch.zeros_like(topk_weights.float()))
    probs.scatter_(1, slot, weights)
    return routing[:, :experts].contiguous(), probs[:, :experts].contiguous()


def _routing_map_to_topk(
    routing: torch.Tensor, probs: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``[rows, local]`` bool map as ``[rows, topk]`` local indices (-1 padded) and weights."""
    rows, local = routing.shape
    order = torch.arange(local, device=routing.device).expand(rows, local)
    keyed = torch.where(routing, order, torch.full_like(order, local))
    keyed = keyed.sort(dim=1).values[:, : min(topk, local)]
    idx = torch.where(keyed < local, keyed, torch.full_like(keyed, -1))
    if idx.shape[1] < topk:
        pad = torch.full((rows, topk - idx.shape[1]), -1, dtype=idx.dtype, device=idx.device)
        idx = torch.cat([idx, pad], dim=1)
    weights = torch.where(
        idx >= 0, probs.gather(1, idx.clamp(min=0)), torch.zeros_like(probs[:, :1])
    )
    return idx, weights


#: The adapter of each ``deep_ep`` API (``BackendSpec.api``): the adapters know APIs, the
#: registry knows which backend ships which, so a backend on a known API needs no code here.
ADAPTERS: dict[str, type[EPBackend]] = {
    cls.api: cls for cls in (DeepEPv1Backend, DeepEPv2Backend, HybridEPBackend)
}


def adapter_for(spec: registry.BackendSpec) -> type[EPBackend]:
    """The adapter of ``spec``'s API, as a class named after the backend (for reports)."""
    base = ADAPTERS[spec.api]
    return type(base.__name__, (base,), {"name": spec.name, "__module__": base.__module__})


BUILTIN: dict[str, type[EPBackend]] = {s.name: adapter_for(s) for s in registry.SPECS}
BUILTIN["torch"] = TorchBackend


def load_backend_class(spec: str) -> type[EPBackend]:
    """Load ``FILE.py:Class`` or ``package.module:Class``; it must subclass EPBackend."""
    target, sep, class_name = spec.rpartition(":")
    if not sep or not target or not class_name:
        raise UsageError(f"--backend-class {spec!r}: expected FILE.py:Class or module:Class")
    if target.endswith(".py") or "/" in target:
        path = Path(target)
        if not path.is_file():
            raise UsageError(f"--backend-class: file not found: {target}")
        module_name = f"_ep_backend_{abs(hash(str(path.resolve())))}"
        spec_obj = importlib.util.spec_from_file_location(module_name, path)
        if spec_obj is None or spec_obj.loader is None:
            raise UsageError(f"--backend-class: cannot load {target} as Python")
        module = importlib.util.module_from_spec(spec_obj)
        spec_obj.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise UsageError(f"--backend-class: cannot import module {target!r}: {exc}") from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise UsageError(f"--backend-class: {target} has no attribute {class_name!r}")
    if not (isinstance(cls, type) and issubclass(cls, EPBackend)):
        raise UsageError(
            f"--backend-class: {class_name} is not a subclass of ep_adapters.EPBackend"
        )
    return cls
