#!/usr/bin/env bash
# check_train (and check_ep) with the torch reference backend on one H200, on the machine's own
# Python and torch (no venv of the project's), from the repository root: what the GPU defaults
# of check_train do on a real GPU. Writes each probe's report and log under OUT.
# Usage: OUT=DIR bash evidence/2026-12-05-h200-check-train/h200-run.sh
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
out=${OUT:?set OUT to the directory for the reports}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
# NVLink multicast stays off on shared machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
run() {
  local name=$1 start=$SECONDS
  shift
  timeout 200 python3 "$@" --json "$out/$name.json" > "$out/$name.log" 2>&1
  echo "=== $name rc=$? $((SECONDS - start)) s"
}
run t1 probes/check_train.py --backend torch
run t2 probes/check_train.py --backend torch --nproc-per-node 2 --ranks-per-gpu 2
run t1cached probes/check_train.py --backend torch --recompute cached --dtype float32
run broken probes/check_train.py \
  --backend-class tests/fixtures/broken_training.py:FewerRowsOnRecompute \
  --nproc-per-node 2 --ranks-per-gpu 2
run leak probes/check_train.py \
  --backend-class tests/fixtures/broken_training.py:KeepsEveryStepsRows
run ep1 probes/check_ep.py --backend torch
