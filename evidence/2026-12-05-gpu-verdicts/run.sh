#!/bin/bash
# The probes' default commands on one GPU, from the lock's venvs that tests/gpu_venvs.py packed
# and tests/gpu_venvs_device.sh unpacked (VENVS, default the prefix they were built under), as
# README tells a user to run them: no flag beyond the backend and the ranks. From the
# repository root on the GPU machine:
#   OUT=DIR bash evidence/2026-12-05-gpu-verdicts/run.sh PHASE...
# Phases: ep (check_ep, every backend at the ranks it needs: 1, or 2 sharing the GPU), ep4
# (DeepEP v1 and HybridEP at 4 shared ranks), train (check_train --all-backends), train4
# (DeepEP v1 and HybridEP at 4 shared ranks), train-each (each backend alone), recheck (DeepEP
# v2's training, its faults and every backend after a fix),
# faults (real adapters with one fault each), order (a routing dispatched twice, compared row
# by row). Each run's report and log land in OUT/<phase>/, one line per run on stdout, and
# OUT/<phase>.tgz holds them (what comes back from the machine).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
here=evidence/2026-12-05-gpu-verdicts
faults="$here/faults.py"
out=${OUT:?set OUT to the directory for the reports}
venvs=${VENVS:-/work/gpu/venvs}
export PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PATH=$CUDA_HOME/bin:$PATH
# NVLink multicast stays off on shared machines (the device tool's KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# What a user has not set: no JIT cache variable, so each venv's own default is what runs.
unset NCCL_EP_JIT_CACHE_DIR EP_JIT_CACHE_DIR HYBRID_EP_CACHE_DIR
# HybridEP's hybrid_ep_cpp links rdma-core's libibverbs and libmlx5, which a GPU node's image
# has; where this machine has none, the copy tests/gpu_venvs.py packed beside the venvs.
if ! ldconfig -p | grep -q 'libibverbs\.so\.1 '; then
  export LD_LIBRARY_PATH=${RDMA_CORE:-/work/gpu/rdma-core/lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi

run() {  # run NAME TIMEOUT BACKEND-VENV ARGS...: one probe, its report and log
  local name=$1 limit=$2 venv=$3 start=$SECONDS rc
  shift 3
  timeout -k 10 "$limit" "$venvs/$venv/bin/python" "$@" --json "$dir/$name.json" \
    > "$dir/$name.log" 2>&1
  rc=$?
  printf '%-40s rc=%-3s %4s s  %s\n' "$name" "$rc" "$((SECONDS - start))" \
    "$(grep -E 'result:|precondition' "$dir/$name.log" | tail -2 | tr -s ' ' | tr '\n' ' ' | cut -c1-200)"
  tar -C "$out" -czf "$out/$phase.tgz" "$phase"  # what has run comes back even if the call is cut
}

shared() {  # the flags of N ranks sharing this one GPU
  echo "--nproc-per-node $1 --ranks-per-gpu $1"
}

for phase in "$@"; do
  dir=$out/$phase
  mkdir -p "$dir"
  echo "=== $phase $(date -u +%H:%M:%S)"
  case $phase in
    ep)
      run ep-deepep_v2-w1 300 deepep_v2 probes/check_ep.py
      run ep-ncclep-w1 300 ncclep probes/check_ep.py
      # shellcheck disable=SC2046
      run ep-deepep_v1-w2 240 deepep_v1 probes/check_ep.py $(shared 2)
      # shellcheck disable=SC2046
      run ep-hybridep-w2 240 hybridep probes/check_ep.py $(shared 2)
      ;;
    ep4)
      # shellcheck disable=SC2046
      run ep-deepep_v1-w4 280 deepep_v1 probes/check_ep.py $(shared 4)
      # shellcheck disable=SC2046
      run ep-hybridep-w4 280 hybridep probes/check_ep.py $(shared 4)
      ;;
    train)
      # Every backend at the ranks it needs (DeepEP v1 and HybridEP: 2 sharing the GPU), each
      # run's own report inside the table's.
      run train-all-backends 560 deepep_v2 probes/check_train.py --all-backends --prefix "$venvs"
      ;;
    train4)
      # shellcheck disable=SC2046
      for backend in deepep_v1 hybridep; do
        run "train-$backend-w4" 280 "$backend" probes/check_train.py $(shared 4)
      done
      ;;
    train-each)
      run train-deepep_v2-w1 300 deepep_v2 probes/check_train.py
      run train-ncclep-w1 300 ncclep probes/check_train.py
      # shellcheck disable=SC2046
      for backend in deepep_v1 hybridep; do
        run "train-$backend-w2" 300 "$backend" probes/check_train.py $(shared 2)
      done
      ;;
    recheck)
      # After the router's recompute replays its forward's choice: DeepEP v2's training and
      # the faults that need its fallback, then every backend again.
      run train-deepep_v2-w1 120 deepep_v2 probes/check_train.py
      for fault in WrongWeights StaleHandleOnRecompute; do
        run "train-deepep_v2-$fault" 100 deepep_v2 probes/check_train.py \
          --backend-class "$faults:$fault"
      done
      run train-all-backends 300 deepep_v2 probes/check_train.py --all-backends --prefix "$venvs"
      run train-deepep_v2-w1-again 120 deepep_v2 probes/check_train.py
      ;;
    faults)
      for fault in LosesOneToken WrongWeights; do
        run "ep-deepep_v2-$fault" 200 deepep_v2 probes/check_ep.py \
          --backend-class "$faults:$fault"
      done
      for fault in WrongWeights StaleHandleOnRecompute; do
        run "train-deepep_v2-$fault" 200 deepep_v2 probes/check_train.py \
          --backend-class "$faults:$fault"
      done
      # shellcheck disable=SC2046
      EP_FAULT_BASE=deepep_v1 run ep-deepep_v1-w2-LosesOneToken 300 deepep_v1 \
        probes/check_ep.py --backend-class "$faults:LosesOneToken" $(shared 2)
      ;;
    order)
      for backend in deepep_v2 ncclep; do
        start=$SECONDS
        timeout -k 10 200 "$venvs/$backend/bin/python" "$here/recompute_order.py" "$backend" \
          > "$dir/order-$backend.json" 2> "$dir/order-$backend.log"
        echo "order-$backend rc=$? $((SECONDS - start)) s $(cut -c1-400 "$dir/order-$backend.json")"
      done
      ;;
    *) echo "unknown phase $phase" >&2 ;;
  esac
  tar -C "$out" -czf "$out/$phase.tgz" "$phase"
done
