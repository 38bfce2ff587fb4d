"""DeepEP v2 (``deep_ep.ElasticBuffer``, JIT kernels): SGLang's wheel, or upstream pinned."""

from ep_image.backends._spec import NCCL, BackendSpec, Provider, Variant

SPEC = BackendSpec(
    name="deepep_v2",
    title=(
        "DeepEP v2 (deep_ep.ElasticBuffer; JIT: needs a CUDA home with nvcc and cuobjdump at "
        "run time)"
    ),
    distribution="sgl-deep-ep",
    layout_marker="buffers/elastic.py",
    api="ElasticBuffer",
    providers=(
        Provider("sgl-deep-ep", "deepep_v2"),
        Provider("tokenspeed-deepep", "deepep_v2"),  # 2.x ships the v2 layout
    ),
    default=True,
    internode_check="nccl_gin",
    needs_nccl_gin=True,
    upstream_test="elastic/test_ep.py",
    shares_gpu=False,
    variants=(
        Variant(
            extra="deepep_v2_pinned",
            distribution="deep-ep",
            summary=(
                "upstream DeepEP at NeMo AutoModel's pinned commit, built from source (nvcc, "
                "NCCL >= 2.30 from the lock) instead of SGLang's wheel"
            ),
            build_needs=(NCCL,),
        ),
    ),
)
