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
        Provider(
            "sgl-deep-ep",
            "deepep_v2",
            upstream="https://github.com/sgl-project/DeepEP",
            no_commit="unknown: SGLang's binary build of its fork sgl-project/DeepEP (its "
            "README); the wheel records no commit",
        ),
        Provider(
            "tokenspeed-deepep",
            "deepep_v2",  # 2.x ships the v2 layout
            no_commit="unknown: a prebuilt wheel whose metadata names neither a source "
            "repository nor a commit",
        ),
    ),
    default=True,
    internode_check="nccl_gin",
    needs_nccl_gin=True,
    upstream_test="elastic/test_ep.py",
    shares_gpu=False,
    jit_cache=("EP_JIT_CACHE_DIR", "deep_ep"),
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
