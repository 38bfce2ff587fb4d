"""The adapter of NCCL EP's ``nccl.ep`` (``Group`` and ``Handle``, nccl-extensions 0.1.0): its
high-throughput algorithm in the flat layout, the one that gives DeepEP's normal layout.

Why this module exists: NCCL EP builds its own NCCL communicator from the process group, takes
preallocated output tensors, keeps the routing in a per-step handle and reads its received-row
counts from the handle; its native library needs the GPU driver before anything else works and
its JIT compiles kernels with nvcc against headers it finds through environment variables. The
adapter does all of that behind :class:`EPBackend` and names each prerequisite before a buffer
is made. Written against the wheel's ``nccl/ep/*.py`` and ``include/nccl_ep.h``.

Its low-latency algorithm (``Algorithm.LOW_LATENCY``: expert-major or rank-major layouts,
weights applied inside combine) is a separate mode with another output layout; this adapter
does not check it, and says so in its facts.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import subprocess
import weakref
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from ep_image import backends as registry
from ep_image.probes import _installed, _mapped
from ep_image.probes._adapters.base import Dispatched, EPBackend, Problem, Shape
from ep_image.probes._adapters.deep_ep_common import pad_rows
from ep_image.probes._report import Status, StepFailed, one_line

MODULE = "nccl.ep"
#: The modes this adapter drives and leaves, for the import step's facts.
MODE = "high-throughput (Algorithm.HIGH_THROUGHPUT), flat layout"
NOT_CHECKED = (
    "low-latency (Algorithm.LOW_LATENCY, expert-major or rank-major layouts): a separate mode, "
    "not checked"
)
DRIVER_FIX = (
    "run on a GPU node with the NVIDIA driver (in a container: the NVIDIA container toolkit, "
    "docker run --gpus all), or pass --backend torch"
)
NCCL_FIX = (
    "install the NCCL nccl-extensions pins (nvidia-nccl-cu13==2.30.7, the lock's: rebuild the "
    "venv with scripts/make_venv.py) and make sure no other libnccl.so.2 comes first "
    "(LD_LIBRARY_PATH, LD_PRELOAD)"
)


@dataclasses.dataclass
class NcclHandle:
    """One dispatch's ``nccl.ep.Handle`` and what must outlive it: the routing it was made
    from, the received slots' local expert indices, the real and the allocated row counts."""

    raw: Any
    rows: int
    padded_rows: int
    keep: list[Any]  # tensors and descriptors the library holds pointers to
    recv_topk_idx: torch.Tensor  # [rows, topk] local expert or -1


class NcclEPBackend(EPBackend):
    """NCCL EP ``nccl.ep.Group`` / ``Handle``, high-throughput algorithm, flat layout.

    The flat layout is DeepEP's normal one: one received row per (token, rank), the top-k
    indices local to the rank (-1 elsewhere), combine summing the rows back unweighted. The
    gradient of dispatch with the top-k weights is its backward combine
    (``CombineConfig(pass_direction=PassDir.BWD)``), which takes the received weights'
    gradients and returns them summed per token and slot; dispatch along a handle without
    weights is its backward dispatch.
    """

    name = ""  # the backend's, given by adapter_for
    module = MODULE
    api = "Group"
    # It JIT-compiles its kernels, but finds nvcc its own way (NCCL_EP_JIT_NVCC, NVCC,
    # $CUDA_HOME/bin/nvcc, $CUDA_PATH/bin/nvcc, then PATH) and reads its headers through
    # NCCL_EP_HOME and NCCL_HOME: prerequisites() checks what it will use, not $CUDA_HOME/bin.
    jit_compiles = False
    jit_cache_variable = "NCCL_EP_JIT_CACHE_DIR"
    # nccl-extensions 0.1.0's cu13 extra pins NCCL 2.30.7; its library uses NCCL's device API
    # (nccl_device, windows, GIN) of that release.
    min_nccl = (2, 30)
    # It creates an NCCL communicator mirroring the group (nccl.ep.interop.torch): NCCL refuses
    # two ranks on one GPU.
    needs_nccl_group = True
    # None declared: nccl_ep.h documents neither uneven token counts (each rank passes its own
    # topk_idx, up to max_dispatch_tokens_per_rank) nor -1 slots as refused; the GPU run tells.
    input_limits: ClassVar[dict[str, str]] = {}

    def jit_cache_dir(self) -> Path | None:
        return Path(str(self._library().jit_inputs(self._module_dir())["cache_dir"]))

    def load(self) -> dict[str, Any]:
        self.ep = importlib.import_module(MODULE)
        self.core = importlib.import_module("nccl.core")
        interop = importlib.import_module("nccl.ep.interop.torch")
        self.comm_from_group = interop.get_nccl_comm_from_group
        module_dir = self._module_dir()
        facts: dict[str, Any] = {
            "module_path": getattr(self.ep, "__file__", None),
            "module_version": self._distribution_version(),
            "mode": MODE,
            "not_checked": NOT_CHECKED,
            **registry.backend_facts(self.name, module_dir),
        }
        facts.update(self._nccl_loaded())
        # The native library loads now, before any buffer: its loader needs the driver's
        # libcuda.so.1 and binds libnccl.so.2 (the one torch loaded, by soname).
        try:
            facts["library_version"] = str(self.ep.get_lib_version())
            facts["library_loaded"] = str(self.ep.get_lib_path())
        except RuntimeError as exc:
            raise self._load_failure(str(exc), facts) from None
        self.facts_loaded = facts
        return facts

    def _nccl_loaded(self) -> dict[str, Any]:
        """The libnccl.so.2 this process has loaded (nccl4py's ncclGetVersion: no driver
        needed) and every libnccl mapped."""
        facts: dict[str, Any] = {}
        try:
            libnccl = self.core.get_version().libnccl
            facts["nccl_loaded"] = str(libnccl.version)
            facts["nccl_loaded_path"] = str(libnccl.path)
        except Exception as exc:  # a fact to report; prerequisites() judges it
            facts["nccl_loaded_error"] = one_line(f"{type(exc).__name__}: {exc}")
        facts["nccl_mapped"] = _mapped.mapped_libraries(r"^libnccl\.so")
        return facts

    def _load_failure(self, message: str, facts: dict[str, Any]) -> StepFailed:
        """The verdict on a libnccl_ep.so that did not load: no driver is "cannot run here"."""
        facts["load_error"] = message
        library = Path(str(facts.get("library") or "libnccl_ep.so")).name
        if "libcuda.so" in message:
            return StepFailed(
                Status.SKIP,
                f"{library} needs the GPU driver's libcuda.so.1, which the loader does not find "
                "here (no NVIDIA driver)",
                DRIVER_FIX,
                facts,
            )
        if "undefined symbol" in message or "libnccl" in message:
            return StepFailed(
                Status.ERROR,
                f"{library} does not load against this libnccl.so.2 "
                f"({facts.get('nccl_bound') or 'not found'}): {one_line(message, 300)}",
                NCCL_FIX,
                facts,
            )
        return StepFailed(Status.ERROR, f"{library} does not load: {one_line(message)}", "", facts)

    def prerequisites(self) -> tuple[dict[str, Any], list[Problem]]:
        """The NCCL loaded and the JIT's compiler and headers, as libnccl_ep will use them."""
        loaded = {**getattr(self, "facts_loaded", {}), **self._nccl_loaded()}
        jit = self._library().jit_inputs(self._module_dir())
        data: dict[str, Any] = {"jit": jit, **loaded}
        problems: list[Problem] = []
        if "nccl_loaded_error" in loaded:
            problems.append(
                (Status.ERROR, f"NCCL does not load: {loaded['nccl_loaded_error']}", NCCL_FIX)
            )
        mapped = loaded.get("nccl_mapped") or []
        if len(set(map(os.path.realpath, mapped))) > 1:
            problems.append(
                (
                    Status.ERROR,
                    f"{len(mapped)} libnccl are mapped in this process: {', '.join(mapped)}",
                    NCCL_FIX,
                )
            )
        problems += self._check_compiler(jit, data)
        problems += self._check_headers(jit, loaded, data)
        return data, problems

    def _check_compiler(self, jit: dict[str, Any], data: dict[str, Any]) -> list[Problem]:
        nvcc = jit.get("nvcc")
        major = self._library().cuda_major()
        fix = (
            f"install a CUDA {major} toolkit and set CUDA_HOME to it (or NCCL_EP_JIT_NVCC to its "
            "bin/nvcc): NCCL EP compiles its kernels at run time, with a compiler of the CUDA "
            "major its bundled library was chosen for (the installed cuda-bindings')"
        )
        if not nvcc or not os.access(nvcc, os.X_OK):
            return [(Status.ERROR, f"no nvcc for NCCL EP's JIT (resolved: {nvcc})", fix)]
        try:
            text = subprocess.run(
                [nvcc, "--version"], capture_output=True, text=True, timeout=60, check=False
            ).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            return [(Status.ERROR, f"{nvcc} --version failed: {exc}", fix)]
        release = next((w.strip(",") for w in text.split() if w.startswith("V")), None)
        data["nvcc_version"] = release
        if release is None or release.lstrip("V").split(".")[0] != major:
            wrong = f"NCCL EP's JIT would run {nvcc} ({release}), not a CUDA {major} nvcc"
            return [(Status.ERROR, wrong, fix)]
        return []

    def _check_headers(
        self, jit: dict[str, Any], loaded: dict[str, Any], data: dict[str, Any]
    ) -> list[Problem]:
        library = self._library()
        problems: list[Problem] = []
        source = Path(str(jit["source_dir"]))
        ep_release = library.include_release(source.parent)
        data["jit_source_release"] = ep_release
        # What the JIT's headers must match: the library loaded, else (no driver to load it)
        # the release of the headers installed with it, which it was built from.
        built = loaded.get("library_version") or library.header_release(self._module_dir())
        if not (source / "device").is_dir():
            problems.append(
                (
                    Status.ERROR,
                    f"NCCL EP's JIT headers are not at {source} (no device/)",
                    "unset NCCL_EP_HOME and NCCL_EP_JIT_SOURCE_DIR (import nccl.ep sets "
                    "NCCL_EP_HOME to the installed package), or point them at its include/",
                )
            )
        elif built and ep_release != built:
            what = "loaded" if loaded.get("library_version") else "installed"
            problems.append(
                (
                    Status.ERROR,
                    f"NCCL EP's JIT headers at {source} are release {ep_release}, the library "
                    f"{what} is {built}",
                    "unset NCCL_EP_HOME and NCCL_EP_JIT_SOURCE_DIR so the JIT compiles against "
                    "the installed package's headers",
                )
            )
        include = Path(str(jit["nccl_include_dir"]))
        nccl_release = library.nccl_header_release(include)
        data["jit_nccl_headers_release"] = nccl_release
        if not (include / "nccl_device").is_dir():
            problems.append(
                (
                    Status.ERROR,
                    f"NCCL's device headers are not at {include} (no nccl_device/): NCCL EP's "
                    "kernels include them",
                    "unset NCCL_HOME and NCCL_EP_JIT_BUILD_INCLUDE_DIR (import nccl.ep sets "
                    "NCCL_HOME to the nvidia-nccl wheel), or point NCCL_HOME at an NCCL with "
                    "include/nccl_device",
                )
            )
        elif loaded.get("nccl_loaded") and nccl_release != loaded["nccl_loaded"]:
            problems.append(
                (
                    Status.ERROR,
                    f"NCCL EP's JIT compiles against NCCL {nccl_release} headers ({include}) "
                    f"while NCCL {loaded['nccl_loaded']} is loaded",
                    "unset NCCL_HOME and NCCL_EP_JIT_BUILD_INCLUDE_DIR (import nccl.ep then uses "
                    "the nvidia-nccl wheel's headers), or point NCCL_HOME at the loaded NCCL",
                )
            )
        cuda_include = jit.get("cuda_include_dir")
        if cuda_include and not Path(str(cuda_include), "cuda_runtime.h").is_file():
            problems.append(
                (
                    Status.ERROR,
                    f"no cuda_runtime.h in {cuda_include}, the CUDA headers NCCL EP's JIT uses",
                    "set CUDA_HOME (or NCCL_EP_JIT_CUDA_INCLUDE_DIR) to the toolkit of its nvcc",
                )
            )
        return problems

    def create(self, group: dist.ProcessGroup, shape: Shape) -> None:
        self.shape = shape
        world = group.size()
        self.local = shape.local_experts(world)
        self.comm = self.comm_from_group(group)
        row_bytes = shape.hidden * torch.tensor([], dtype=shape.dtype).element_size()
        self.max_recv = shape.tokens * world  # flat: at most one row per (token, rank)
        config = self.ep.GroupConfig(
            algorithm=self.ep.Algorithm.HIGH_THROUGHPUT,
            num_experts=shape.experts,
            max_dispatch_tokens_per_rank=shape.tokens,
            max_recv_tokens_per_rank=self.max_recv,
            max_token_bytes=-(-row_bytes // 16) * 16,  # HT: a multiple of 16
            num_topk=shape.topk,
        )
        self.group = self.ep.Group.create(self.comm, config)
        #: Each dispatch's handle is destroyed when its NcclHandle is dropped, or at destroy().
        self.handles: list[weakref.finalize] = []

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> Dispatched:
        ep, dev, k = self.ep, x.device, self.shape.topk
        idx = topk_idx.to(torch.int64).contiguous()
        weights = topk_weights.float().contiguous()
        x = x.contiguous()
        counters = torch.zeros(self.local, dtype=torch.int32, device=dev)
        total = torch.zeros(1, dtype=torch.int32, device=dev)
        keep: list[Any] = [idx, weights, x, counters, total]
        layout = ep.LayoutInfo(
            expert_counters=self._keep(keep, counters),
            recv_total_counter=self._keep(keep, total),
            recv_topk_idx_kind=ep.ExpertIdKind.LOCAL,
        )
        raw = self.group.create_handle(
            ep.Layout.FLAT, self._keep(keep, idx), layout_info=layout, stream=self._stream()
        )
        recv_x = x.new_zeros((self.max_recv, x.shape[1]))
        recv_w = torch.zeros((self.max_recv, k), dtype=torch.float32, device=dev)
        recv_idx = torch.full((self.max_recv, k), -1, dtype=torch.int64, device=dev)
        raw.dispatch(
            ep.DispatchInputs(tokens=self._keep(keep, x), topk_weights=self._keep(keep, weights)),
            ep.DispatchOutputs(
                tokens=self._keep(keep, recv_x),
                topk_weights=self._keep(keep, recv_w),
                topk_idx=self._keep(keep, recv_idx),
            ),
            stream=self._stream(),
        )
        rows = int(total.item())  # written at handle time; item() waits for the stream
        handle = NcclHandle(raw, rows, self.max_recv, keep, recv_idx[:rows])
        self.handles = [f for f in self.handles if f.alive]
        self.handles.append(weakref.finalize(handle, raw.destroy))
        return Dispatched(
            recv_x=recv_x[:rows],
            recv_topk_idx=recv_idx[:rows],
            recv_topk_weights=recv_w[:rows],
            num_recv_per_expert=[int(c) for c in counters.tolist()],
            handle=handle,
        )

    def combine(self, y: torch.Tensor, handle: NcclHandle) -> torch.Tensor:
        tokens = self._tokens_of(handle)
        combined = y.new_zeros((tokens, y.shape[1]))
        padded = pad_rows(y, handle.padded_rows).contiguous()
        keep = [padded, combined]
        handle.raw.combine(
            self.ep.CombineInputs(tokens=self._keep(keep, padded)),
            self.ep.CombineOutputs(tokens=self._keep(keep, combined)),
            stream=self._stream(),
        )
        return combined

    def dispatch_cached(self, x: torch.Tensor, handle: NcclHandle) -> torch.Tensor:
        ep = self.ep
        x = x.contiguous()
        recv_x = x.new_zeros((handle.padded_rows, x.shape[1]))
        keep = [x, recv_x]
        handle.raw.dispatch(
            ep.DispatchInputs(tokens=self._keep(keep, x)),
            ep.DispatchOutputs(tokens=self._keep(keep, recv_x)),
            config=ep.DispatchConfig(pass_direction=ep.PassDir.BWD),
            stream=self._stream(),
        )
        return recv_x[: handle.rows]

    def dispatch_backward_with_weights(
        self, grad_recv_x: torch.Tensor, grad_recv_topk_weights: torch.Tensor, handle: NcclHandle
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ep = self.ep
        # Slots whose expert is on another rank send nothing from this rank (the contract),
        # whatever the caller put there.
        grad_w = torch.where(
            handle.recv_topk_idx >= 0,
            grad_recv_topk_weights.float(),
            torch.zeros_like(grad_recv_topk_weights, dtype=torch.float32),
        )
        padded_x = pad_rows(grad_recv_x, handle.padded_rows).contiguous()
        padded_w = pad_rows(grad_w, handle.padded_rows).contiguous()
        tokens = self._tokens_of(handle)
        out_x = grad_recv_x.new_zeros((tokens, grad_recv_x.shape[1]))
        out_w = torch.zeros((tokens, self.shape.topk), dtype=torch.float32, device=out_x.device)
        keep = [padded_x, padded_w, out_x, out_w]
        inputs = ep.CombineInputs(
            tokens=self._keep(keep, padded_x), topk_weights=self._keep(keep, padded_w)
        )
        outputs = ep.CombineOutputs(
            tokens=self._keep(keep, out_x), topk_weights=self._keep(keep, out_w)
        )
        handle.raw.combine(
            inputs,
            outputs,
            config=ep.CombineConfig(pass_direction=ep.PassDir.BWD),
            stream=self._stream(),
        )
        return out_x, out_w

    def destroy(self) -> None:
        for finalizer in getattr(self, "handles", []):
            finalizer()  # each handle once, whether or not its tensors are still referenced
        group = getattr(self, "group", None)
        if group is not None:
            group.destroy()
            self.group = None
        comm = getattr(self, "comm", None)
        if comm is not None:
            comm.destroy()
            self.comm = None

    # --- helpers ----------------------------------------------------------------------------

    def _keep(self, keep: list[Any], t: torch.Tensor) -> Any:
        """An ``nccl.ep.Tensor`` of ``t``, kept alive (with ``t``) as long as ``keep``."""
        described = self.ep.Tensor(t)
        keep.append(described)
        return described

    def _tokens_of(self, handle: NcclHandle) -> int:
        """The dispatching rank's token count, as the handle's routing was made from."""
        return int(handle.keep[0].shape[0])

    def _stream(self) -> int:
        return int(torch.cuda.current_stream().cuda_stream)

    def _module_dir(self) -> Path:
        found = _installed.module_dir(MODULE)
        if found is None:
            raise StepFailed(Status.MISSING, f"no module named {MODULE}", "")
        return found

    def _distribution_version(self) -> str | None:
        found = _installed.dist_version(registry.spec(self.name).distribution)
        return found[1] if found else None

    def _library(self) -> Any:
        """The backend's own reading of its installed library (its registry package)."""
        return registry.module_of(self.name, registry.spec(self.name).facts_module)
