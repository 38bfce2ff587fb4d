#!/bin/bash
# On the H200 machine, once h200-build-te.sh has built the TE wheel: the deepep_v2 venv made
# again by scripts/make_venv.py from uv.lock with that wheel, then check_te (fused attention
# forward and backward on the cuDNN that venv loads) and check_env from its python.
cd "$(dirname "$0")/../.." || exit 2
# shellcheck source=evidence/2026-12-03/h200-common.sh
. evidence/2026-12-03/h200-common.sh
py=$(cat /tmp/carry/python)
te=$(ls /tmp/te/transformer_engine-*.whl)
UV_CACHE_DIR=/tmp/carry/uv UV_OFFLINE=1 run make_venv-te "$py" scripts/make_venv.py \
  --backend deepep_v2 --prefix /tmp/te-venvs --python "$py" --te-wheel "$te"
V=/tmp/te-venvs/deepep_v2/bin/python
run check_te-deepep_v2 "$V" probes/check_te.py --require --te-build-info /tmp/te/te-build.json \
  --json "$R/check_te-deepep_v2.json"
run check_env-te-venvs-deepep_v2 "$V" probes/check_env.py --json "$R/check_env-te-venvs-deepep_v2.json"
cp /tmp/te/te-build.json "$R/te-build.json"
touch "$R/te.done"
