#!/bin/sh
# ep-stage.sh BACKEND: the Dockerfile's `ep-<backend>` stages. Builds /opt/venvs/BACKEND with
# scripts/make_venv.py when EP selects BACKEND; otherwise leaves /opt/venvs empty (a no-op, so
# that an image holding one backend never builds the others).
#
# Inputs (environment): EP, VENV_SKIP_PACKAGES, UV_PYTHON, TORCH_CUDA_ARCH_LIST, MAX_JOBS; /src
# holds pyproject.toml, uv.lock and scripts/; /opt/te holds the TE wheel from the `te` stage
# (none when TE_BUILD=skip). The venv is hardlink-deduplicated here, in the layer that creates
# it. /opt/ep-stage/BACKEND.json records what the stage did.
set -eu

backend=$1
prefix=/opt/venvs
mkdir -p "$prefix" /opt/ep-stage
record=/opt/ep-stage/$backend.json
if ! select-ep "$EP" | grep -qx "$backend"; then
    echo "ep-stage: EP=$EP does not select $backend; nothing to build"
    printf '{"backend": "%s", "selected": false, "ep": "%s"}\n' "$backend" "$EP" > "$record"
    exit 0
fi

set --
for wheel in /opt/te/transformer_engine-*.whl; do
    [ -f "$wheel" ] && set -- "$@" --te-wheel "$wheel"
done
[ $# -gt 0 ] || echo "ep-stage: no TE wheel (TE_BUILD=skip): $backend gets no transformer-engine"
for package in $VENV_SKIP_PACKAGES; do
    set -- "$@" --no-install-package "$package"
done

if [ "$backend" = hybridep ]; then
    # HybridEP is compiled from its git source by uv. Its setup.py links NVSHMEM from
    # NVSHMEM_DIR: give it the lock's nvidia-nvshmem-cu13 at a fixed path, which the final stage
    # points at the venv's identical copy (the rpath the build records stays valid).
    version=$(python3 - /src/uv.lock <<'PY'
import sys, tomllib
with open(sys.argv[1], "rb") as fh:
    lock = tomllib.load(fh)
print(next(p["version"] for p in lock["package"] if p["name"] == "nvidia-nvshmem-cu13"))
PY
)
    uv pip install --quiet --no-deps --target /opt/nvshmem "nvidia-nvshmem-cu13==$version"
    export NVSHMEM_DIR=/opt/nvshmem/nvidia/nvshmem
    for lib in "$NVSHMEM_DIR"/lib/libnvshmem_host.so.*; do
        ln -sf "${lib##*/}" "$NVSHMEM_DIR/lib/libnvshmem_host.so"
    done
    echo "ep-stage: NVSHMEM_DIR=$NVSHMEM_DIR (nvidia-nvshmem-cu13 $version from uv.lock)"
fi

python3 /src/scripts/make_venv.py --backend "$backend" --prefix "$prefix" --project /src \
    --python "$UV_PYTHON" "$@"
python3 /src/scripts/dedup.py "$prefix/$backend"
# The record embeds ep-backend.json (lock hash, creation time), so it changes with the venv.
printf '{"backend": "%s", "selected": true, "ep": "%s", "ep_backend": %s}\n' \
    "$backend" "$EP" "$(cat "$prefix/$backend/ep-backend.json")" > "$record"
