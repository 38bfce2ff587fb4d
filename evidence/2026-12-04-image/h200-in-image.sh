#!/bin/bash
# h200-in-image.sh NAME [VAR=VALUE ...] -- CMD [ARG ...]
# Run CMD in the entered image as `docker run -e VAR=VALUE IMAGE CMD` would: a clean
# environment made of the image's own ENV (image.json, from its config) and the -e values, the
# image's WORKDIR, its ENTRYPOINT before CMD; EP_IMAGE_REF names the image (name@id) for the
# reports, as CI's in-image.sh passes the digest it pulled. Output in /tmp/r/NAME.log; the exit code and
# seconds appended to /tmp/r/summary.txt.
set -uo pipefail
R=/tmp/rootfs
name=$1
shift
extra=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do extra+=("$1"); shift; done
shift
mapfile -d '' config < <(python3 -c '
import json, sys
i = json.load(open("/tmp/img/image.json"))
c = i["config"]
ref = i["image"] + "@sha256:" + i["image_id"]
sys.stdout.write("\0".join([ref, c["WorkingDir"], *c["Entrypoint"], *c["Env"]]) + "\0")')
ref=${config[0]} workdir=${config[1]} entrypoint=${config[2]} env=("${config[@]:3}")
start=$(date +%s)
# Kept on, as on every machine of this kind: NVLink multicast stays off.
# shellcheck disable=SC2016  # $0 and $@ are the inner shell's
timeout "${LIMIT:-600}" chroot "$R" /usr/bin/env -i "${env[@]}" HOME=/root \
  HOSTNAME="$(hostname)" EP_IMAGE_REF="$ref" NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 \
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1 "${extra[@]}" \
  /bin/sh -c 'cd "$0" && exec "$@"' "$workdir" "$entrypoint" "$@" > "/tmp/r/$name.log" 2>&1
rc=$?
echo "$name rc=$rc $(( $(date +%s) - start ))s" | tee -a /tmp/r/summary.txt
exit $rc
