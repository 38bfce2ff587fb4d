#!/bin/sh
# te-stage.sh: the Dockerfile's `te` stage. Builds the Transformer Engine wheel once, against
# the cuDNN that uv installs from the lock, or records that the build was skipped.
#
# Why a separate script: the stage has two modes and a source choice, which read better as shell
# than as one RUN line; the Dockerfile still shows every input it gets (ARGs, bind mounts).
# Inputs (environment): TE_BUILD (build|skip), TORCH_CUDA_ARCH_LIST, MAX_JOBS,
# NVTE_BUILD_THREADS_PER_JOB, UV_PYTHON; /src holds pyproject.toml, uv.lock, build_te.py and
# te-context/ (the build-context directory TE_SOURCE names). Output: /opt/te/te-build.json and,
# when built, /opt/te/transformer_engine-*.whl. The build venv and TE source are deleted at the
# end of this RUN, so its layer holds just the wheel and its record.
set -eu

out=/opt/te
project=/src

if [ "$TE_BUILD" = skip ]; then
    exec python3 "$project/build_te.py" --skip \
        "TE_BUILD=skip: CPU-only test image, Transformer Engine not built" \
        --arch-list "$TORCH_CUDA_ARCH_LIST" --project "$project" --out "$out"
fi
if [ "$TE_BUILD" != build ]; then
    echo "te-stage: TE_BUILD must be 'build' or 'skip', got '$TE_BUILD'" >&2
    exit 2
fi

# The environment TE compiles against: the lock's moe extra (torch, cuDNN, cudnn-frontend, NCCL,
# NVSHMEM), without TE itself, exactly as the backend venvs get it (no bytecode: it lives only
# for this RUN).
venv=/tmp/te-venv
uv venv --python "$UV_PYTHON" "$venv"
UV_PROJECT_ENVIRONMENT=$venv UV_COMPILE_BYTECODE=0 uv sync --frozen --no-install-project --project "$project" \
    --extra moe --no-install-package transformer-engine

# TE source: the TE_SOURCE context directory if it holds a checkout, else a clone of the git
# URL and commit that pyproject.toml [tool.uv.sources] pins (one source of truth for the pin).
src=/src/te-context
if [ -f "$src/setup.py" ]; then
    echo "te-stage: TE source from the build context (TE_SOURCE)"
else
    rm -rf "$src"
    set -- $(python3 - "$project/pyproject.toml" <<'PY'
import sys, tomllib
with open(sys.argv[1], "rb") as fh:
    source = tomllib.load(fh)["tool"]["uv"]["sources"]["transformer-engine"]
print(source["git"], source["rev"])
PY
)
    echo "te-stage: cloning $1 at $2 (pinned in pyproject.toml)"
    git clone --quiet "$1" "$src"
    git -C "$src" checkout --quiet "$2"
    git -C "$src" submodule update --init --recursive --quiet
fi

python3 "$project/build_te.py" --venv "$venv" --source "$src" \
    --arch-list "$TORCH_CUDA_ARCH_LIST" --jobs "$MAX_JOBS" \
    --threads-per-job "$NVTE_BUILD_THREADS_PER_JOB" --project "$project" --out "$out" \
    --install-build-deps
rm -rf "$venv" "$src"
