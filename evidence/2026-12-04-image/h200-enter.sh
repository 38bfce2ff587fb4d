#!/bin/bash
# On the H200, once every part is here: waits for h200-unpack.sh to finish /tmp/rootfs, checks
# every regular file against the image's manifest (sha256 of each file, written from the
# image in buildah's storage), then set up as a container runtime sets up a container: the
# host's /dev, /proc, /sys and the driver (/usr/local/nvidia, read-only) mounted in, and, as
# `docker run --network host` does, the host's /etc/hosts and /etc/hostname. Nothing else of
# the host is visible inside. Two volumes: /mnt/reports (the reports) and /mnt/upstream (the
# backends' own tests at their pinned commits, the oracles).
set -euo pipefail
R=/tmp/rootfs I=/tmp/img
cd "$I"
until [ -e unpack.rc ]; do sleep 1; done
cat unpack.log
[ "$(cat unpack.rc)" = 0 ] || exit 1
zstd=$(command -v zstd || echo "$I/zstd")
start=$(date +%s)
"$zstd" -d -q -c manifest.sha256.zst > manifest.sha256
split -n l/16 manifest.sha256 manifest.chunk.
fails=0
for chunk in manifest.chunk.*; do
  (cd "$R" && sha256sum -c --quiet "$I/$chunk") > "$chunk.out" 2>&1 &
done
wait
cat manifest.chunk.*.out > manifest.check.txt
fails=$(grep -c -v ': OK$' manifest.check.txt || true)
echo "manifest: $(wc -l < manifest.sha256) files checked in $(( $(date +%s) - start )) s, $fails differ"
[ "$fails" = 0 ] || { head -20 manifest.check.txt; exit 1; }
mount --rbind /dev "$R/dev"
mount -t proc proc "$R/proc"
mount --rbind /sys "$R/sys"
mkdir -p "$R/usr/local/nvidia" "$R/mnt/reports" "$R/mnt/upstream" /tmp/r
mount --bind /usr/local/nvidia "$R/usr/local/nvidia"
mount -o remount,bind,ro "$R/usr/local/nvidia"
for f in /etc/hosts /etc/hostname; do touch "$R$f"; mount --bind "$f" "$R$f"; done
# The image finds the driver through NGC's LD_LIBRARY_PATH (/usr/local/nvidia/lib, lib64). Where
# this host keeps libcuda.so.1 elsewhere under /usr/local/nvidia, do what the NVIDIA container
# toolkit does: name its directory to the image's loader (ld.so.conf.d + ldconfig), and say so.
driver=$(find /usr/local/nvidia -name 'libcuda.so.1' 2>/dev/null | head -1)
case "$driver" in
  /usr/local/nvidia/lib/libcuda.so.1 | /usr/local/nvidia/lib64/libcuda.so.1) ;;
  "") echo "enter: no libcuda.so.1 under /usr/local/nvidia" >&2; exit 1 ;;
  *) dirname "$driver" > "$R/etc/ld.so.conf.d/zz-container-driver.conf"
     chroot "$R" ldconfig
     echo "enter: the driver is in $(dirname "$driver"): added to the image's ld.so.conf.d" ;;
esac
mount --bind /tmp/r "$R/mnt/reports"
mount --bind "$I/upstream" "$R/mnt/upstream"
# shellcheck disable=SC2016  # expanded inside the image
echo "entered: $(chroot "$R" /bin/sh -c '. /etc/os-release; echo "$PRETTY_NAME"')"
