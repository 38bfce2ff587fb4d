#!/bin/bash
# DeepEP v1 again, after uv.lock gained numpy in its extra: its venv made again from the new lock
# by scripts/make_venv.py (offline; the build is the cache's), then check_ep at 2 and 4 ranks.
cd "$(dirname "$0")/../.." || exit 2
# shellcheck source=evidence/2026-12-03/h200-common.sh
. evidence/2026-12-03/h200-common.sh
py=$(cat /tmp/carry/python)
UV_CACHE_DIR=/tmp/carry/uv UV_OFFLINE=1 run make_venv-deepep_v1-relocked "$py" \
  scripts/make_venv.py --backend deepep_v1 --prefix /tmp/venvs --python "$py"
V1=/tmp/venvs/deepep_v1/bin/python
run deepep_v1-w2-deepseek-v3 "$V1" probes/check_ep.py --backend deepep_v1 --nproc-per-node 2 \
  --ranks-per-gpu 2 --require --timeout 300 --json "$R/deepep_v1-w2-deepseek-v3.json"
run deepep_v1-w4-deepseek-v3 "$V1" probes/check_ep.py --backend deepep_v1 --nproc-per-node 4 \
  --ranks-per-gpu 4 --require --timeout 300 --json "$R/deepep_v1-w4-deepseek-v3.json"
run deepep_v1-w2-qwen3-30b-a3b "$V1" probes/check_ep.py --backend deepep_v1 --nproc-per-node 2 \
  --ranks-per-gpu 2 --hidden 2048 --experts 128 --topk 8 --require --timeout 300 \
  --json "$R/deepep_v1-w2-qwen3-30b-a3b.json"
run check_env-venvs-deepep_v1 "$V1" probes/check_env.py --json "$R/check_env-venvs-deepep_v1.json"
cp /tmp/venvs/deepep_v1/ep-backend.json "$R/record-venvs-deepep_v1.json"
touch "$R/v1.done"
