#!/bin/bash
# DeepEP v1 (2 and 4 ranks sharing the GPU) and DeepEP v2 (1 rank, GIN on and off, the
# default wheel and the pinned upstream commit), each beside its own upstream test.
cd "$(dirname "$0")/../.." || exit 2
# shellcheck source=evidence/2026-12-03/h200-common.sh
. evidence/2026-12-03/h200-common.sh
V1=/tmp/venvs/deepep_v1/bin/python V2=/tmp/venvs/deepep_v2/bin/python P=/tmp/pinned/deepep_v2/bin/python
v1() {
  run deepep_v1-w2-deepseek-v3 "$V1" probes/check_ep.py --backend deepep_v1 --nproc-per-node 2 \
    --ranks-per-gpu 2 --require --timeout 300 --json "$R/deepep_v1-w2-deepseek-v3.json"
  run deepep_v1-w4-deepseek-v3 "$V1" probes/check_ep.py --backend deepep_v1 --nproc-per-node 4 \
    --ranks-per-gpu 4 --require --timeout 300 --json "$R/deepep_v1-w4-deepseek-v3.json"
  run deepep_v1-w2-qwen3-30b-a3b "$V1" probes/check_ep.py --backend deepep_v1 --nproc-per-node 2 \
    --ranks-per-gpu 2 --hidden 2048 --experts 128 --topk 8 --require --timeout 300 \
    --json "$R/deepep_v1-w2-qwen3-30b-a3b.json"
  run upstream-deepep_v1-w2 "$V1" probes/upstream_test.py --backend deepep_v1 \
    --tests "$S/DeepEP-567632dd/tests" --commit 567632dd59810d77b3cc05553df953cc0f779799 \
    --num-processes 2 --shared-gpu --shape deepseek-v3 --timeout 500 \
    --json "$R/upstream-deepep_v1-w2-deepseek-v3.json"
}
v1_w4_upstream() {
  run upstream-deepep_v1-w4 "$V1" probes/upstream_test.py --backend deepep_v1 \
    --tests "$S/DeepEP-567632dd/tests" --commit 567632dd59810d77b3cc05553df953cc0f779799 \
    --num-processes 4 --shared-gpu --shape deepseek-v3 --timeout 500 \
    --json "$R/upstream-deepep_v1-w4-deepseek-v3.json"
}
# v2 NAME PYTHON TESTS COMMIT: GIN on (DeepEP's default), then off; its test beside each.
v2() {
  local tag=$1 py=$2 tests=$3 commit=$4
  export EP_JIT_CACHE_DIR=/tmp/jit-$tag
  run "$tag-w1-deepseek-v3-gin" "$py" probes/check_ep.py --backend deepep_v2 --require \
    --timeout 300 --json "$R/$tag-w1-deepseek-v3-gin.json"
  run "upstream-$tag-w1-gin" "$py" probes/upstream_test.py --backend deepep_v2 --tests "$tests" \
    --commit "$commit" --num-processes 1 --shape deepseek-v3 --timeout 300 \
    --json "$R/upstream-$tag-w1-deepseek-v3-gin.json" -- --skip-perf-test
  EP_DISABLE_GIN=1 run "$tag-w1-deepseek-v3-nogin" "$py" probes/check_ep.py --backend deepep_v2 \
    --require --timeout 300 --json "$R/$tag-w1-deepseek-v3-nogin.json"
  EP_DISABLE_GIN=1 run "upstream-$tag-w1-nogin" "$py" probes/upstream_test.py --backend deepep_v2 \
    --tests "$tests" --commit "$commit" --num-processes 1 --shape deepseek-v3 --timeout 300 \
    --json "$R/upstream-$tag-w1-deepseek-v3-nogin.json" -- --skip-perf-test
}
v1 & v1_w4_upstream &
v2 deepep_v2 "$V2" "$S/DeepEP-dd758caf/tests" dd758caf451848bd150e1046af3d0a73e5fff38d &
v2 deepep_v2_pinned "$P" "$S/DeepEP-af9a0403/tests" af9a0403188392824fc3057452822235873e0612 &
wait
for py in "$V1" "$V2" $P; do
  tag=$(basename "$(dirname "$(dirname "$(dirname "$py")")")")-$(basename "$(dirname "$(dirname "$py")")")
  run "check_env-$tag" "$py" probes/check_env.py --json "$R/check_env-$tag.json"
done
touch "$R/probes-1.done"
