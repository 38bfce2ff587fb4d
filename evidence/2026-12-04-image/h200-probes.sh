#!/bin/bash
# On the H200, in the entered image (h200-enter.sh): every probe from the image's own venvs and
# entrypoint, each beside its backend's own upstream test. Three lanes run at once, one per
# backend (the GPU is shared; ranks of one lane share it too, so no figure here is a link
# figure). Each command's log and JSON report land in /tmp/r (/mnt/reports inside), its exit
# code and seconds in /tmp/r/summary.txt; /tmp/r/probes.done marks the end.
cd "$(dirname "$0")" || exit 2
run() { ./h200-in-image.sh "$@"; }
J=/mnt/reports U=/mnt/upstream
V1=567632dd59810d77b3cc05553df953cc0f779799 V2=dd758caf451848bd150e1046af3d0a73e5fff38d
HY=e0a5b1d9848ab3e7b4a67842bf06f067bfac67f8

lane_v2_te() {  # the default backend (active without EP_BACKEND) and TE
  run nvidia-smi -- nvidia-smi -L
  run check_env -- probes/check_env.py --json $J/check_env.json
  run check_te -- probes/check_te.py --require --json $J/check_te.json
  run deepep_v2-w1-gin -- probes/check_ep.py --require --json $J/deepep_v2-w1-gin.json
  run deepep_v2-w1-nogin EP_DISABLE_GIN=1 -- probes/check_ep.py --require \
    --json $J/deepep_v2-w1-nogin.json
  run upstream-deepep_v2-w1-nogin EP_DISABLE_GIN=1 -- probes/upstream_test.py \
    --backend deepep_v2 --tests $U/DeepEP-dd758caf/tests --commit $V2 --num-processes 1 \
    --shape deepseek-v3 --timeout 400 --json $J/upstream-deepep_v2-w1-nogin.json -- --skip-perf-test
  run upstream-deepep_v2-w1-gin -- probes/upstream_test.py --backend deepep_v2 \
    --tests $U/DeepEP-dd758caf/tests --commit $V2 --num-processes 1 --shape deepseek-v3 \
    --timeout 500 --json $J/upstream-deepep_v2-w1-gin.json -- --skip-perf-test
}

lane_v1() {
  for n in 2 4; do
    run deepep_v1-w$n EP_BACKEND=deepep_v1 -- probes/check_ep.py --nproc-per-node $n \
      --ranks-per-gpu $n --require --json $J/deepep_v1-w$n.json
  done
  for n in 2 4; do
    run upstream-deepep_v1-w$n EP_BACKEND=deepep_v1 -- probes/upstream_test.py \
      --backend deepep_v1 --tests $U/DeepEP-567632dd/tests --commit $V1 --num-processes $n \
      --shared-gpu --shape deepseek-v3 --timeout 500 --json $J/upstream-deepep_v1-w$n.json
  done
}

lane_hybridep() {
  for n in 2 4; do
    run hybridep-w$n EP_BACKEND=hybridep -- probes/check_ep.py --nproc-per-node $n \
      --ranks-per-gpu $n --require --json $J/hybridep-w$n.json
  done
  run upstream-hybridep-w4 EP_BACKEND=hybridep -- probes/upstream_test.py --backend hybridep \
    --tests $U/DeepEP-e0a5b1d9/tests --commit $HY --num-processes 4 --shared-gpu \
    --shape deepseek-v3 --timeout 500 --json $J/upstream-hybridep-w4.json
}

lane_switch() {  # use-ep --activate inside one container: the probe follows the active venv
  # shellcheck disable=SC2016  # expanded inside the image
  run use-ep-switch -- sh -c 'use-ep --list && eval "$(use-ep --activate deepep_v1)" &&
    readlink /opt/venvs/active && probes/check_ep.py --nproc-per-node 2 --ranks-per-gpu 2 \
    --scenarios none --require --json /mnt/reports/check_ep-after-switch.json; rc=$?;
    eval "$(use-ep --activate deepep_v2)"; readlink /opt/venvs/active; exit $rc'
}

lane_no_ordering() {  # the cuDNN ordering removed on purpose, after every other run
  # 1. The environment's part gone: no CUDNN_PATH/CUDNN_HOME, the venv's cuDNN not on
  #    LD_LIBRARY_PATH (the base image's own entries only); the image's ld.so.conf.d entry stays.
  run check_te-no-env-ordering CUDNN_PATH= CUDNN_HOME= \
    LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64 -- \
    probes/check_te.py --require --json $J/check_te-no-env-ordering.json
  # 2. All of it gone: also the loader's entry that puts the venv's cuDNN ahead of the base
  #    image's (/etc/ld.so.conf.d/000-ep-venv-cudnn.conf), then put back.
  local conf=/tmp/rootfs/etc/ld.so.conf.d/000-ep-venv-cudnn.conf
  mv "$conf" /tmp/r/000-ep-venv-cudnn.conf && chroot /tmp/rootfs ldconfig
  run check_te-no-ordering CUDNN_PATH= CUDNN_HOME= \
    LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64 -- \
    probes/check_te.py --require --json $J/check_te-no-ordering.json
  mv /tmp/r/000-ep-venv-cudnn.conf "$conf" && chroot /tmp/rootfs ldconfig
}

lane_v2_te > /tmp/r/lane-v2-te.out 2>&1 &
lane_v1 > /tmp/r/lane-v1.out 2>&1 &
lane_hybridep > /tmp/r/lane-hybridep.out 2>&1 &
wait
lane_switch > /tmp/r/lane-switch.out 2>&1
lane_no_ordering > /tmp/r/lane-no-ordering.out 2>&1
touch /tmp/r/probes.done
