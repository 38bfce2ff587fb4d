"""What the source builds (TE, DeepEP v1, HybridEP) share among the build steps: the machine's
part of a build (``toolchain``), uv's cache keyed on what uv does not key on (``uv_cache``),
the NVSHMEM set-up of DeepEP's builds (``nvshmem``), prebuilt wheels taken only when their
record matches (``prebuilt``)."""
