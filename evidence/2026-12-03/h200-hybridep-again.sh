#!/bin/bash
# HybridEP again, compiled with the system's gcc/g++: the machine's CUDAHOSTCXX and /opt/gcc
# link libstdc++ statically (check_ep's SIGSEGV verdict names it). The old build leaves uv's
# cache first (the build key holds no compiler), then the probes of h200-probes-2.sh.
cd "$(dirname "$0")/../.." || exit 2
# shellcheck source=/dev/null
. /tmp/carry/env.sh
unset CUDAHOSTCXX
export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
py=$(cat /tmp/carry/python)
start=$(date +%s)
{ uv cache clean deep-ep && MAX_JOBS=16 "$py" scripts/make_venv.py --backend hybridep \
    --prefix /tmp/venvs --python "$py"; } > /tmp/bg/hybridep-again.log 2>&1
echo "rc=$? $(( $(date +%s) - start ))s" > /tmp/bg/hybridep-again.status
rm -f /tmp/r/probes-2.done
bash evidence/2026-12-03/h200-probes-2.sh
