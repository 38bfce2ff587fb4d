#!/bin/bash
# On the H200: take what this call carried (.xfer/<n>/: one part of the image's root file system,
# and with the first call SHA256SUMS, the manifest, image.json, zstd and the upstream tests) into
# /tmp/img, check every part here against SHA256SUMS, and start the unpacker (h200-unpack.sh)
# once. Prints how many parts are here.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../.."
mkdir -p /tmp/img
for dir in .xfer/*/; do
  [ -d "$dir" ] && cp -a "$dir". /tmp/img/ && rm -rf "$dir"
done
cd /tmp/img
for part in rootfs.tar.zst.[0-9][0-9][0-9]; do
  [ -e "$part" ] && [ ! -e "$part.ok" ] || continue
  grep " $part\$" SHA256SUMS | sha256sum -c --quiet && touch "$part.ok"
done
if [ ! -e unpack.started ]; then
  touch unpack.started
  setsid nohup bash "$here/h200-unpack.sh" > /dev/null 2>&1 < /dev/null &
fi
echo "parts here: $(find . -name 'rootfs.tar.zst.*.ok' | wc -l) of $(wc -l < SHA256SUMS)"
