#!/bin/bash
# On the H200 machine, once every part has arrived in /tmp/parts: the bundle back together, then
# the backend venvs built from uv.lock by scripts/make_venv.py, offline (UV_OFFLINE: uv takes
# only what its cache holds), on the machine's system Python 3.12, never its torch venv.
# DeepEP v1 and the pinned v2 come from the cache's builds (made on the CPU machine for sm_90);
# HybridEP is compiled here, and Transformer Engine by scripts/build_te.py, both in the
# background (setsid: they outlive this call) while the probes of the first venvs run.
set -euo pipefail
cd "$(dirname "$0")/../.."
parts=/tmp/parts B=/tmp/carry out=${OUT:-/tmp/out} bg=/tmp/bg
mkdir -p "$B" "$out" "$bg"
start=$(date +%s)
(cd "$parts" && sha256sum -c --quiet SHA256SUMS)
zstd=$(command -v zstd || echo "$parts/zstd")
cat "$parts"/p[0-9]* | "$zstd" -d -q --long=27 -c | tar -x -C "$B"
rm -f "$parts"/p[0-9]*
echo "unpacked in $(( $(date +%s) - start )) s: $(du -sh "$B" | cut -f1)" | tee "$out/setup.log"
# git reaches the pinned commits through the carried mirrors (uv's git db has them already).
cat > "$B/gitconfig" <<EOF
[url "file://$B/mirrors/DeepEP.git"]
	insteadOf = https://github.com/deepseek-ai/DeepEP
[url "file://$B/mirrors/nccl.git"]
	insteadOf = https://github.com/NVIDIA/nccl.git
[protocol "file"]
	allow = always
EOF
cat > "$B/env.sh" <<EOF
unset PYTHONPATH VIRTUAL_ENV
export PATH=$B/bin:/usr/local/nvidia/bin:/usr/local/cuda/bin:/usr/local/bin:/usr/bin:/bin:/opt/gcc/bin
export GIT_CONFIG_GLOBAL=$B/gitconfig GIT_CONFIG_NOSYSTEM=1
export UV_CACHE_DIR=$B/uv UV_OFFLINE=1 UV_PYTHON_DOWNLOADS=never UV_LINK_MODE=hardlink
export CUDA_HOME=/usr/local/cuda TORCH_CUDA_ARCH_LIST=9.0
export LD_LIBRARY_PATH=/usr/local/nvidia/lib64:/usr/local/nvidia/lib
EOF
# shellcheck source=/dev/null
. "$B/env.sh"
py=/usr/bin/python3.12
[ -x "$py" ] || py=$(python3 -c 'import os, sys; print(os.path.join(sys.base_prefix, "bin", "python3"))')
echo "python: $py ($("$py" --version))" | tee -a "$out/setup.log"
echo "$py" > "$B/python"
t=$(date +%s)
MAX_JOBS=16 "$py" scripts/make_venv.py --backend deepep_v1 --backend deepep_v2 --prefix /tmp/venvs \
  --python "$py" --keep-going >> "$out/setup.log" 2>&1 || echo "make_venv v1/v2: exit $?" >> "$out/setup.log"
MAX_JOBS=16 "$py" scripts/make_venv.py --backend deepep_v2 --variant deepep_v2_pinned --prefix /tmp/pinned \
  --python "$py" >> "$out/setup.log" 2>&1 || echo "make_venv pinned: exit $?" >> "$out/setup.log"
echo "make_venv (deepep_v1, deepep_v2, deepep_v2_pinned): $(( $(date +%s) - t )) s" | tee -a "$out/setup.log"
# In the background: HybridEP's source build (10 jobs) and TE's (6 jobs), each with its status.
setsid bash -c "t=\$(date +%s); MAX_JOBS=10 '$py' scripts/make_venv.py --backend hybridep \
  --prefix /tmp/venvs --python '$py' > $bg/hybridep.log 2>&1; \
  echo \"rc=\$? \$(( \$(date +%s) - t ))s\" > $bg/hybridep.status" < /dev/null > /dev/null 2>&1 &
setsid bash evidence/2026-12-03/h200-build-te.sh < /dev/null > /dev/null 2>&1 &
tail -3 "$out/setup.log"
