#!/bin/bash
# On the H200, after h200-probes.sh: DeepEP v2 failed at its first dispatch (its JIT runs
# $CUDA_HOME/bin/cuobjdump, which the stand-in base's CUDA home lacked and NGC's devel image
# has). Completes the stand-in's CUDA home with NVIDIA's cuobjdump (carried in .xfer/cuobj, from
# the nvidia-cuda-cuobjdump 13.2.51 wheel: the oldest CUDA 13 release on PyPI), then runs the
# DeepEP v2 lane again, and the cuDNN ordering lane, whose first check_te had not ended (it is
# stopped here, its log kept), each command bounded.
cd "$(dirname "$0")" || exit 2
R=/tmp/rootfs J=/mnt/reports U=/mnt/upstream
V2=dd758caf451848bd150e1046af3d0a73e5fff38d
# shellcheck disable=SC2009  # the listing keeps each process's elapsed seconds; pgrep has none
ps -eo pid,etimes,args | grep "[c]heck_te\.py" > /tmp/r/check_te-stopped.txt
# Those listed, by their process ids: TERM, then KILL whichever is still there 2 s later.
mapfile -t pids < <(awk '{print $1}' /tmp/r/check_te-stopped.txt)
if [ "${#pids[@]}" -gt 0 ]; then
  kill "${pids[@]}" 2>/dev/null
  sleep 2
  for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && kill -9 "$pid"; done
fi
install -m 0755 /tmp/img/cuobjdump "$R/usr/local/cuda-13.0/bin/cuobjdump"
run() { ./h200-in-image.sh "$@"; }
lane_v2() {
  run deepep_v2-w1-gin-2 -- probes/check_ep.py --require --json $J/deepep_v2-w1-gin-2.json
  run deepep_v2-w1-nogin-2 EP_DISABLE_GIN=1 -- probes/check_ep.py --require \
    --json $J/deepep_v2-w1-nogin-2.json
  run upstream-deepep_v2-w1-nogin-2 EP_DISABLE_GIN=1 -- probes/upstream_test.py \
    --backend deepep_v2 --tests $U/DeepEP-dd758caf/tests --commit $V2 --num-processes 1 \
    --shape deepseek-v3 --timeout 200 --json $J/upstream-deepep_v2-w1-nogin-2.json -- --skip-perf-test
  LIMIT=330 run upstream-deepep_v2-w1-gin-2 -- probes/upstream_test.py --backend deepep_v2 \
    --tests $U/DeepEP-dd758caf/tests --commit $V2 --num-processes 1 --shape deepseek-v3 \
    --timeout 320 --json $J/upstream-deepep_v2-w1-gin-2.json -- --skip-perf-test
}
lane_cudnn() {
  LIMIT=150 run check_te-no-env-ordering-2 CUDNN_PATH= CUDNN_HOME= \
    LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64 -- \
    probes/check_te.py --require --json $J/check_te-no-env-ordering-2.json
  local conf=$R/etc/ld.so.conf.d/000-ep-venv-cudnn.conf
  mv "$conf" /tmp/r/000-ep-venv-cudnn.conf && chroot $R ldconfig
  LIMIT=150 run check_te-no-ordering-2 CUDNN_PATH= CUDNN_HOME= \
    LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64 -- \
    probes/check_te.py --require --json $J/check_te-no-ordering-2.json
  mv /tmp/r/000-ep-venv-cudnn.conf "$conf" && chroot $R ldconfig
}
lane_v2 > /tmp/r/lane-v2-2.out 2>&1 &
lane_cudnn > /tmp/r/lane-cudnn-2.out 2>&1 &
wait
touch /tmp/r/rerun.done
