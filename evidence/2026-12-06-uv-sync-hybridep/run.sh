#!/bin/bash
# `uv sync --extra hybridep` as a user types it (the card's second usage), on this build machine,
# from an empty uv cache (DeepEP's and NCCL's sources fresh, so NCCL's make runs whole): its
# time, and every 5 s the load average, the memory left, the compiler processes running and
# the OOM killer's count. From the repository root:
#   OUT=DIR [LIMIT=SECONDS] bash evidence/2026-12-06-uv-sync-hybridep/run.sh
# The build machine's own set-up comes from the caller's environment: GIT_CONFIG_GLOBAL (git
# mirrors of DeepEP and NCCL through insteadOf), and, on a machine without a GPU driver, the
# stand-ins tests/gpu_venvs.py makes (LIBRARY_PATH: driver stubs; CPLUS_INCLUDE_PATH and
# C_INCLUDE_PATH: the math libraries' headers and nvml.h). TORCH_CUDA_ARCH_LIST defaults to 9.0.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
out=${OUT:?set OUT to the directory for the samples and the log}
limit=${LIMIT:-4200}
mkdir -p "$out"
work=$(mktemp -d)
sampler=
cleanup() {
  [ -n "$sampler" ] && kill "$sampler" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
mkdir "$work/project"
git archive HEAD | tar -x -C "$work/project"
export UV_CACHE_DIR=$work/uv-cache TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
oom() { awk '$1 == "oom_kill" { print $2 }' /proc/vmstat; }
oom_before=$(oom)
{
  printf 'seconds\tload1\tmem_available_mib\tcompilers\toom_kills\n'
  start=$SECONDS
  while sleep 5; do
    printf '%s\t%s\t%s\t%s\t%s\n' "$((SECONDS - start))" "$(cut -d' ' -f1 /proc/loadavg)" \
      "$(awk '/MemAvailable/ { print int($2 / 1024) }' /proc/meminfo)" \
      "$(pgrep -c -x 'cc1plus|cicc|cudafe\+\+|ptxas|nvcc' || true)" "$(($(oom) - oom_before))"
  done
} > "$out/samples.tsv" &
sampler=$!
start=$SECONDS
(cd "$work/project" && timeout -k 10 "$limit" python3 scripts/bootstrap.py -- uv sync --extra hybridep) \
  > "$out/uv-sync.log" 2>&1
rc=$?
seconds=$((SECONDS - start))
kill "$sampler" 2>/dev/null
sampler=
python3 - "$out/samples.tsv" "$rc" "$seconds" > "$out/summary.json" <<'PY'
import csv, json, sys
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
print(json.dumps({
    "exit_code": int(sys.argv[2]), "seconds": int(sys.argv[3]), "samples": len(rows),
    "load1_max": max((float(r["load1"]) for r in rows), default=None),
    "mem_available_mib_min": min((int(r["mem_available_mib"]) for r in rows), default=None),
    "compilers_max": max((int(r["compilers"]) for r in rows), default=None),
    "oom_kills": int(rows[-1]["oom_kills"]) if rows else None,
}, indent=2))
PY
cat "$out/summary.json"
