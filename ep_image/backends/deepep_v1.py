"""DeepEP v1 (``deep_ep.Buffer``): upstream's last commit before v2, source-built."""

from ep_image.backends._spec import NVSHMEM, BackendSpec, Provider

SPEC = BackendSpec(
    name="deepep_v1",
    title="DeepEP v1 (deep_ep.Buffer)",
    distribution="deep-ep",
    layout_marker="buffer.py",
    api="Buffer",
    # tokenspeed-deepep 1.x wheels ship the v1 layout (built against another torch: not used).
    providers=(Provider("tokenspeed-deepep", "deepep_v1", major="1"),),
    builds_from_source=True,
    build_needs=(NVSHMEM,),
    links_nvshmem=True,
    internode_check="nvshmem",
    upstream_test="test_intranode.py",
    # Its intranode kernels exist for these (the adapter skips any other world size).
    world_sizes=(2, 4, 8),
    build_hint=(
        "compiled from its pinned git commit against the venv's torch and NVSHMEM: needs git "
        "access to the commit (GitHub, or a mirror through url.<mirror>.insteadOf), a CUDA "
        "toolkit with nvcc, and libcuda.so to link (the driver's, or the toolkit's stub)"
    ),
)
