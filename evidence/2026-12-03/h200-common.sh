# shellcheck shell=bash
# Sourced by the h200-probes-*.sh scripts: the environment every probe runs in, and `run`.
# Each probe runs from its venv's own python (made by h200-setup.sh from uv.lock), with nothing
# of the machine's own Python stack on the path: the reports' "environment" block shows it.
# shellcheck source=/dev/null
. /tmp/carry/env.sh
unset UV_CACHE_DIR UV_OFFLINE
# Kept on, as on every machine of this kind: NVLink multicast stays off.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export S=/tmp/carry/src  # the upstream tests, for the scripts that source this
R=/tmp/r
mkdir -p "$R"

# run NAME CMD...: the command's output in $R/NAME.log, its exit code and seconds in summary.txt.
run() {
  local name=$1 start rc
  shift
  start=$(date +%s)
  timeout "${LIMIT:-400}" "$@" > "$R/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc $(( $(date +%s) - start ))s" | tee -a "$R/summary.txt"
}
