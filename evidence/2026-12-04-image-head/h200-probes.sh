#!/bin/bash
# On the H200, in the image rebuilt at this page's commit and entered as the first run's scripts
# enter one (../2026-12-04-image/h200-enter.sh): three lanes at once, one GPU shared.
#  v1:     check_ep's verdict on the real DeepEP v1 with one fault on one rank (faults.py), then
#          DeepEP v1 whole at 2 and 4 ranks beside its own test.
#  hybrid: HybridEP at 2 and 4 ranks; whether HybridEP's own kernel cache serves a second
#          process (against the project's); its own test at 2 ranks (the first run had 4
#          only), then at 4.
#  v2/te:  check_env; DeepEP v2 in the stand-in's CUDA home without cuobjdump (check_ep's
#          prerequisites must refuse it), then with it (carried, as in the first run) GIN on and
#          off beside its own test; check_te, and its verdict with CUDNN_PATH set empty and with
#          the base's cuDNN first on LD_LIBRARY_PATH.
# Then use-ep switching the active venv, alone.
# Logs and reports in /tmp/r (/mnt/reports inside); exit code and seconds of each command in
# /tmp/r/summary.txt; /tmp/r/probes.done marks the end.
here=$(cd "$(dirname "$0")" && pwd)
run() { "$here/../2026-12-04-image/h200-in-image.sh" "$@"; }
R=/tmp/rootfs J=/mnt/reports U=/mnt/upstream
V1=567632dd59810d77b3cc05553df953cc0f779799 V2=dd758caf451848bd150e1046af3d0a73e5fff38d
HY=e0a5b1d9848ab3e7b4a67842bf06f067bfac67f8
# The plugins the runs load, in /mnt/upstream: root's, read by the ranks.
cp "$here/faults.py" "$here/hybridep_own_cache.py" /tmp/img/upstream/

lane_v1() {
  for fault in NaNInOneCombinedRow HalvedCombineOnOneRank; do
    LIMIT=200 run "deepep_v1-w2-$fault" EP_BACKEND=deepep_v1 -- probes/check_ep.py \
      --backend-class "$U/faults.py:$fault" --nproc-per-node 2 --ranks-per-gpu 2 \
      --json "$J/deepep_v1-w2-$fault.json"
  done
  LIMIT=200 run deepep_v1-w4-NaNInOneCombinedRow EP_BACKEND=deepep_v1 -- probes/check_ep.py \
    --backend-class "$U/faults.py:NaNInOneCombinedRow" --nproc-per-node 4 --ranks-per-gpu 4 \
    --json "$J/deepep_v1-w4-NaNInOneCombinedRow.json"
  for n in 2 4; do
    run deepep_v1-w$n EP_BACKEND=deepep_v1 -- probes/check_ep.py --nproc-per-node $n \
      --ranks-per-gpu $n --require --json $J/deepep_v1-w$n.json
  done
  for n in 2 4; do
    run upstream-deepep_v1-w$n EP_BACKEND=deepep_v1 -- probes/upstream_test.py \
      --backend deepep_v1 --tests $U/DeepEP-567632dd/tests --commit $V1 --num-processes $n \
      --shared-gpu --shape deepseek-v3 --timeout 400 --json $J/upstream-deepep_v1-w$n.json
  done
}

lane_hybridep() {
  for n in 2 4; do
    run hybridep-w$n EP_BACKEND=hybridep -- probes/check_ep.py --nproc-per-node $n \
      --ranks-per-gpu $n --require --json $J/hybridep-w$n.json
  done
  # Does HybridEP's own kernel cache serve a second process? Twice with the project's cache
  # off and HybridEP's own (load_cached_kernels=True, one HYBRID_EP_CACHE_DIR for every
  # process), then once more with the project's cache, which the w2 run above filled.
  for i in 1 2; do
    run hybridep-w2-own-cache-$i EP_BACKEND=hybridep EP_HYBRIDEP_JIT_CACHE=off \
      HYBRID_EP_CACHE_DIR=/var/tmp/hybrid-ep-own -- probes/check_ep.py \
      --backend-class "$U/hybridep_own_cache.py:HybridEPOwnCache" --nproc-per-node 2 \
      --ranks-per-gpu 2 --scenarios none --json $J/hybridep-w2-own-cache-$i.json
  done
  run hybridep-w2-project-cache-warm EP_BACKEND=hybridep -- probes/check_ep.py \
    --nproc-per-node 2 --ranks-per-gpu 2 --scenarios none \
    --json $J/hybridep-w2-project-cache-warm.json
  for n in 2 4; do
    run upstream-hybridep-w$n EP_BACKEND=hybridep -- probes/upstream_test.py \
      --backend hybridep --tests $U/DeepEP-e0a5b1d9/tests --commit $HY --num-processes $n \
      --shared-gpu --shape deepseek-v3 --timeout 500 --json $J/upstream-hybridep-w$n.json
  done
}

lane_v2_te() {
  run nvidia-smi -- nvidia-smi -L
  run check_env -- probes/check_env.py --json $J/check_env.json
  LIMIT=120 run deepep_v2-w1-no-cuobjdump -- probes/check_ep.py --require \
    --json $J/deepep_v2-w1-no-cuobjdump.json
  install -m 0755 /tmp/img/cuobjdump "$R/usr/local/cuda-13.0/bin/cuobjdump"
  run deepep_v2-w1-gin -- probes/check_ep.py --require --json $J/deepep_v2-w1-gin.json
  run deepep_v2-w1-nogin EP_DISABLE_GIN=1 -- probes/check_ep.py --require \
    --json $J/deepep_v2-w1-nogin.json
  run upstream-deepep_v2-w1-gin -- probes/upstream_test.py --backend deepep_v2 \
    --tests $U/DeepEP-dd758caf/tests --commit $V2 --num-processes 1 --shape deepseek-v3 \
    --timeout 300 --json $J/upstream-deepep_v2-w1-gin.json -- --skip-perf-test
  run upstream-deepep_v2-w1-nogin EP_DISABLE_GIN=1 -- probes/upstream_test.py \
    --backend deepep_v2 --tests $U/DeepEP-dd758caf/tests --commit $V2 --num-processes 1 \
    --shape deepseek-v3 --timeout 300 --json $J/upstream-deepep_v2-w1-nogin.json -- --skip-perf-test
  run check_te -- probes/check_te.py --require --json $J/check_te.json
  LIMIT=120 run check_te-cudnn-path-empty CUDNN_PATH= CUDNN_HOME= \
    LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64 -- \
    probes/check_te.py --require --json $J/check_te-cudnn-path-empty.json
  LIMIT=120 run check_te-system-cudnn-first \
    LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu:/opt/venvs/active-cudnn/lib:/usr/local/nvidia/lib:/usr/local/nvidia/lib64 \
    -- probes/check_te.py --require --json $J/check_te-system-cudnn-first.json
}

lane_switch() {  # after the other lanes: /opt/venvs/active-cudnn is on every lane's paths
  # shellcheck disable=SC2016  # expanded inside the image
  run use-ep-switch -- sh -c 'use-ep --list && eval "$(use-ep --activate deepep_v1)" &&
    readlink /opt/venvs/active && probes/check_ep.py --nproc-per-node 2 --ranks-per-gpu 2 \
    --scenarios none --require --json /mnt/reports/check_ep-after-switch.json; rc=$?;
    eval "$(use-ep --activate deepep_v2)"; readlink /opt/venvs/active; exit $rc'
}

lane_v1 > /tmp/r/lane-v1.out 2>&1 &
lane_hybridep > /tmp/r/lane-hybridep.out 2>&1 &
lane_v2_te > /tmp/r/lane-v2-te.out 2>&1 &
wait
lane_switch > /tmp/r/lane-switch.out 2>&1
touch /tmp/r/probes.done
