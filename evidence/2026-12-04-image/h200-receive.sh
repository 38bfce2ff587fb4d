#!/bin/bash
# On the H200: take what this call carried (.xfer/<n>/: one part of the image's root file system,
# and with the first part SHA256SUMS, the manifest, image.json, zstd and the upstream tests) into
# /tmp/img, and check every part here against SHA256SUMS. Prints how many parts are here.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p /tmp/img
for dir in .xfer/*/; do
  [ -d "$dir" ] && cp -a "$dir". /tmp/img/ && rm -rf "$dir"
done
cd /tmp/img
for part in rootfs.tar.zst.[0-9][0-9][0-9]; do
  [ -e "$part.ok" ] && continue
  grep " $part\$" SHA256SUMS | sha256sum -c --quiet && touch "$part.ok"
done
echo "parts here: $(find . -name 'rootfs.tar.zst.*.ok' | wc -l) of $(wc -l < SHA256SUMS); disk: $(df -h /tmp | tail -1)"
