#!/bin/bash
# On the CPU build machine: lay out what the device calls carry, one folder a call, under the
# repository's .xfer/ (ignored by git through .git/info/exclude, never committed):
#   .xfer/000   SHA256SUMS, manifest.sha256.zst, image.json (from `tests/gpu_image.py export`),
#               a zstd binary (the H200 may have none), and upstream/: the backends' own
#               tests/ at their pinned commits (the oracles; from a DeepEP mirror, never committed)
#   .xfer/NNN   part NNN of the root file system (hard links to the export's files)
# Usage: pack-xfer.sh EXPORT_DIR UPSTREAM_DIR
set -euo pipefail
export_dir=${1:?export directory} upstream=${2:?upstream tests directory}
cd "$(dirname "$0")/../.."
grep -qx '/.xfer/' .git/info/exclude || echo '/.xfer/' >> .git/info/exclude
rm -rf .xfer
mkdir -p .xfer/000
cp "$export_dir"/SHA256SUMS "$export_dir"/manifest.sha256.zst "$export_dir"/image.json .xfer/000/
cp "$(command -v zstd)" .xfer/000/zstd
cp -a "$upstream" .xfer/000/upstream
for part in "$export_dir"/rootfs.tar.zst.[0-9][0-9][0-9]; do
  n=$(printf '%03d' $((10#${part##*.} + 1)))
  mkdir -p ".xfer/$n"
  ln "$part" ".xfer/$n/"
done
du -sh .xfer/000; echo "$(find .xfer -name 'rootfs.tar.zst.*' | wc -l) parts"
