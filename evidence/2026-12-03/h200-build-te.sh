#!/bin/bash
# On the H200 machine (started by h200-setup.sh): Transformer Engine built from its pinned
# source by scripts/build_te.py, in a throwaway venv from uv.lock (the lock's torch 2.14.1 and
# cuDNN 9.24), for sm_90. Writes /tmp/bg/te.status when done.
cd "$(dirname "$0")/../.." || exit 2
bg=/tmp/bg B=/tmp/carry
# shellcheck source=/dev/null
. "$B/env.sh"
py=$(cat "$B/python")
export UV_PYTHON=$py
# TE's NCCL EP needs its nccl submodule, which the snapshot leaves out; TE's setup.py would
# otherwise run `git submodule update` (no network here).
export NVTE_WITH_NCCL_EP=0 NVTE_SKIP_SUBMODULE_CHECKS_DURING_BUILD=1
# util/logging.h includes nccl.h even with NCCL EP off: the lock's nvidia-nccl-cu13 headers.
nccl_include=$(echo /tmp/venvs/deepep_v2/lib/python3*/site-packages/nvidia/nccl/include)
export CPATH=$nccl_include
start=$(date +%s)
"$py" scripts/build_te.py --source "$B/te-src" --arch-list 9.0 --jobs 6 --install-build-deps \
  --out /tmp/te > "$bg/te.log" 2>&1
echo "rc=$? $(( $(date +%s) - start ))s" > "$bg/te.status"
