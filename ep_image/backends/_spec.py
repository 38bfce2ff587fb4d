"""What a backend module declares: its spec. No pins here: those live in pyproject.toml."""

from __future__ import annotations

from dataclasses import dataclass

#: The Python module DeepEP and its branches ship, so no two of them share a venv (uv's
#: conflicts). A backend with a module of its own says so (``BackendSpec.module``).
MODULE = "deep_ep"

#: What ``build_needs`` may hold. NVSHMEM: the source build links NVSHMEM from NVSHMEM_DIR;
#: make_venv points that at the venv's own nvidia-nvshmem
#: (ep_image/build_steps/_source_builds/nvshmem.py).
NVSHMEM = "nvshmem"
#: NCCL: the source build links ``-l:libnccl.so.2`` without a ``-L`` for it (DeepEP v2's
#: setup.py at af9a0403); make_venv puts the venv's own nvidia-nccl on that build's LIBRARY_PATH.
NCCL = "nccl"

#: How the probes judge a build's internode support (``BackendSpec.internode_check``).
INTERNODE_CHECKS = (
    "nvshmem",  # the extension links libnvshmem_host: internode and low-latency kernels built
    "rdma",  # the extension links libibverbs + libmlx5 or NIXL: a multinode build
    "nccl_gin",  # NCCL >= 2.30 with GPU-initiated networking
)

#: How a backend's own test takes the MoE shape (``BackendSpec.upstream_shape``).
UPSTREAM_SHAPES = (
    "flags",  # DeepEP's --num-tokens, --hidden, --num-topk, --num-experts
    "env",  # HybridEP's HIDDEN_DIM, NUM_TOKENS_PER_RANK, NUM_LOCAL_EXPERTS, TOPK, ...
)


@dataclass(frozen=True)
class Provider:
    """A distribution known to install a backend's module and the backend its name stands for.

    ``backend`` None: the name alone does not tell (a git build of DeepEP); the file layout
    decides. ``major``: the rule applies only to versions with this major number.
    """

    distribution: str
    backend: str | None
    major: str | None = None
    #: A prebuilt wheel that records no commit: the repository it comes from (where known), and
    #: what the probes report as its commit (the why of "unknown").
    upstream: str | None = None
    no_commit: str = ""


@dataclass(frozen=True)
class Variant:
    """Another uv extra that installs the same backend from another source: same layout, same
    probes, same venv name; only where the distribution comes from differs (``--variant``)."""

    extra: str
    distribution: str
    summary: str
    #: Build-time needs of this source (see NVSHMEM, NCCL), in place of the backend's.
    build_needs: tuple[str, ...] = ()


@dataclass(frozen=True)
class BackendSpec:
    """What identifies a backend; no pins (those are read from pyproject.toml)."""

    #: Backend name, also the uv extra, the module's name and the image's stage suffix (no "-").
    name: str
    #: For people: what it is and its main buffer class.
    title: str
    #: The distribution that installs this backend's module in the lock.
    distribution: str
    #: A path inside the module's directory that only this backend's layout ships.
    layout_marker: str
    #: The class of ``module`` the probes drive (the adapter that speaks its API, chosen in
    #: ep_image/probes/_adapters/plugins.py by module and class): "Buffer",
    #: "ElasticBuffer", "HybridEPBuffer" of ``deep_ep``; "Group" of ``nccl.ep``.
    api: str
    #: The Python module it ships, as imported: DeepEP's ``deep_ep`` (shared by DeepEP's
    #: branches, hence their conflict), or a module of its own (NCCL EP's ``nccl.ep``).
    module: str = MODULE
    #: Backends whose marker this layout ships as well (so this marker is tested first).
    also_ships_markers_of: tuple[str, ...] = ()
    #: Other distributions known to install this backend (tokenspeed-deepep, ...).
    providers: tuple[Provider, ...] = ()
    #: The image's and host mode's default backend (exactly one module says so).
    default: bool = False
    #: Compiled during the build (its image stage then takes the arch list and job count).
    builds_from_source: bool = False
    #: Build-time needs the build scripts act on (see NVSHMEM).
    build_needs: tuple[str, ...] = ()
    #: What building it needs from the machine, for error messages and docs.
    build_hint: str = "prebuilt wheel from PyPI: nothing to compile"
    #: Its compiled extension links NVSHMEM when built with it (internode and low-latency
    #: kernels); a build without NVSHMEM silently loses them, so the probes report which it is.
    links_nvshmem: bool = False
    #: One of INTERNODE_CHECKS.
    internode_check: str = ""
    #: Needs NCCL GIN, hence an RDMA NIC, even on one node.
    needs_nccl_gin: bool = False
    #: Its own test in its repository, under tests/ at the commit its layout follows (the
    #: upstream-test oracle), how that test takes the shape (UPSTREAM_SHAPES), and whether
    #: several ranks may share a GPU there (False: it builds NCCL communicators, which refuse).
    upstream_test: str = ""
    upstream_shape: str = "flags"
    shares_gpu: bool = True
    #: The world sizes its one-node kernels run at (empty: any from ``min_ranks`` up): DeepEP
    #: v1's intranode kernels exist for 2, 4 and 8 ranks. ``check-train --all-backends`` starts
    #: each backend at the most of these the GPUs hold, one rank a GPU, else at its fewest,
    #: ranks sharing a GPU.
    world_sizes: tuple[int, ...] = ()
    #: The fewest ranks it is run at, where ``world_sizes`` is empty.
    min_ranks: int = 1
    #: pyproject.toml's [tool.uv.extra-build-variables] of its distribution are its switches
    #: (HybridEP's multi-node build); a variant sharing the distribution ignores them.
    reads_build_variables: bool = False
    #: Other extras that install this backend from another source.
    variants: tuple[Variant, ...] = ()
    #: Where it keeps kernels it compiles at run time, in the image: (the variable that points
    #: its cache there, the directory under /var/cache/ep-jit). The image's ``image-<EP>``
    #: stages set it (docs/image.md), so one volume keeps every backend's kernels.
    jit_cache: tuple[str, str] | None = None
    #: A module of the backend's package (``ep_image/backends/<name>/<facts_module>.py``) whose
    #: ``facts(module_dir)`` tells, without importing the backend, what check-env reports of its
    #: native library (NCCL EP's libnccl_ep.so: path, release, the libnccl it binds to).
    facts_module: str = ""

    @property
    def extra(self) -> str:
        return self.name

    @property
    def fewest_ranks(self) -> int:
        """The fewest ranks it runs at."""
        return min(self.world_sizes) if self.world_sizes else self.min_ranks

    @property
    def module_path(self) -> str:
        """The module's directory relative to site-packages (``nccl.ep``: ``nccl/ep``)."""
        return self.module.replace(".", "/")

    @property
    def marker_file(self) -> str:
        """The layout marker relative to site-packages."""
        return f"{self.module_path}/{self.layout_marker}"

    def upstream_shape_arguments(
        self, shape: tuple[int, int, int, int], ranks: int
    ) -> tuple[list[str], dict[str, str]]:
        """The upstream test's flags or environment for (tokens, hidden, experts, topk)."""
        tokens, hidden, experts, topk = shape
        if self.upstream_shape == "env":
            return [], {
                "HIDDEN_DIM": str(hidden),
                "MAX_NUM_OF_TOKENS_PER_RANK": str(tokens),
                "NUM_TOKENS_PER_RANK": str(tokens),
                "NUM_LOCAL_EXPERTS": str(experts // ranks),
                "TOPK": str(topk),
            }
        flags = ["--num-tokens", str(tokens), "--hidden", str(hidden)]
        return [*flags, "--num-topk", str(topk), "--num-experts", str(experts)], {}
