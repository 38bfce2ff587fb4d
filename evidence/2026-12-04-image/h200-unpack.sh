#!/bin/bash
# On the H200, started in the background by the first h200-receive.sh: unpacks the image's root
# file system into /tmp/rootfs while the parts arrive, each part as soon as it is here and
# checked, in order (a part is removed once read). Writes /tmp/img/unpack.rc when done.
set -uo pipefail
I=/tmp/img R=/tmp/rootfs
cd "$I" || exit 2
zstd=$(command -v zstd || echo "$I/zstd")
want=$(wc -l < SHA256SUMS)
mkdir -p "$R"
start=$(date +%s)
for i in $(seq 0 $((want - 1))); do
  part=$(printf 'rootfs.tar.zst.%03d' "$i")
  until [ -e "$part.ok" ]; do sleep 0.5; done
  cat "$part" && rm -f "$part"
done | "$zstd" -d --long=31 -q -c | tar -C "$R" --numeric-owner -xpf -
rc=$?
echo "unpack rc=$rc, $(( $(date +%s) - start )) s from the first part" > unpack.log
echo "$rc" > unpack.rc
