#!/bin/bash
# HybridEP (2 and 4 ranks sharing the GPU, its JIT cache cold then warm) beside its upstream
# test, once h200-setup.sh's background build has made its venv.
cd "$(dirname "$0")/../.." || exit 2
# shellcheck source=evidence/2026-12-03/h200-common.sh
. evidence/2026-12-03/h200-common.sh
H=/tmp/venvs/hybridep/bin/python
export EP_HYBRIDEP_JIT_CACHE=/tmp/jit-hybridep
hyb() {
  run hybridep-w2-deepseek-v3-jit-cold "$H" probes/check_ep.py --backend hybridep \
    --nproc-per-node 2 --ranks-per-gpu 2 --require --timeout 400 \
    --json "$R/hybridep-w2-deepseek-v3-jit-cold.json"
  run hybridep-w2-deepseek-v3-jit-warm "$H" probes/check_ep.py --backend hybridep \
    --nproc-per-node 2 --ranks-per-gpu 2 --require --timeout 400 \
    --json "$R/hybridep-w2-deepseek-v3-jit-warm.json"
  run hybridep-w4-deepseek-v3 "$H" probes/check_ep.py --backend hybridep --nproc-per-node 4 \
    --ranks-per-gpu 4 --require --timeout 400 --json "$R/hybridep-w4-deepseek-v3.json"
}
hyb_upstream() {
  # The upstream test needs numpy: the lock's numpy 2.5.5 as unpacked in uv's cache.
  PYTHONPATH=$(dirname "$(ls -d /tmp/carry/uv/archive-v0/*/numpy-2.5.5.dist-info)")
  export PYTHONPATH
  for n in 2 4; do
    run upstream-hybridep-w$n "$H" probes/upstream_test.py --backend hybridep \
      --tests "$S/DeepEP-e0a5b1d9/tests" --commit e0a5b1d9848ab3e7b4a67842bf06f067bfac67f8 \
      --num-processes $n --shared-gpu --shape deepseek-v3 --timeout 450 \
      --json "$R/upstream-hybridep-w$n-deepseek-v3.json"
  done
}
hyb & hyb_upstream &
wait
run check_env-venvs-hybridep "$H" probes/check_env.py --json "$R/check_env-venvs-hybridep.json"
touch "$R/probes-2.done"
