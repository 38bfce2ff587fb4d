#!/bin/bash
# The upstream tests need numpy, which no backend venv holds: it comes from the lock's cache into
# an overlay directory on PYTHONPATH for the upstream tests alone (the venvs stay as built).
cd "$(dirname "$0")/../.." || exit 2
# shellcheck source=evidence/2026-12-03/h200-common.sh
. evidence/2026-12-03/h200-common.sh
py=$(cat /tmp/carry/python)
# numpy 2.5.5 (the lock's, for TE), unpacked in uv's cache: a site directory as it stands.
PYTHONPATH=$(dirname "$(ls -d /tmp/carry/uv/archive-v0/*/numpy-2.5.5.dist-info)")
export PYTHONPATH
V1=/tmp/venvs/deepep_v1/bin/python V2=/tmp/venvs/deepep_v2/bin/python P=/tmp/pinned/deepep_v2/bin/python
up_v1() {
  for n in 2 4; do
    run upstream-deepep_v1-w$n "$V1" probes/upstream_test.py --backend deepep_v1 \
      --tests "$S/DeepEP-567632dd/tests" --commit 567632dd59810d77b3cc05553df953cc0f779799 \
      --num-processes $n --shared-gpu --shape deepseek-v3 --timeout 300 \
      --json "$R/upstream-deepep_v1-w$n-deepseek-v3.json"
  done
}
up_v2() {
  local tag=$1 py=$2 tests=$3 commit=$4
  export EP_JIT_CACHE_DIR=/tmp/jit-$tag
  run "upstream-$tag-w1-gin" "$py" probes/upstream_test.py --backend deepep_v2 --tests "$tests" \
    --commit "$commit" --num-processes 1 --shape deepseek-v3 --timeout 300 \
    --json "$R/upstream-$tag-w1-deepseek-v3-gin.json" -- --skip-perf-test
  EP_DISABLE_GIN=1 run "upstream-$tag-w1-nogin" "$py" probes/upstream_test.py --backend deepep_v2 \
    --tests "$tests" --commit "$commit" --num-processes 1 --shape deepseek-v3 --timeout 300 \
    --json "$R/upstream-$tag-w1-deepseek-v3-nogin.json" -- --skip-perf-test
}
up_v1 &
up_v2 deepep_v2 "$V2" "$S/DeepEP-dd758caf/tests" dd758caf451848bd150e1046af3d0a73e5fff38d &
up_v2 deepep_v2_pinned "$P" "$S/DeepEP-af9a0403/tests" af9a0403188392824fc3057452822235873e0612 &
wait
touch "$R/oracles.done"
