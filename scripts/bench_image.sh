#!/usr/bin/env bash
# bench_image.sh: the image benchmark of docs/image.md, as root, from the repository root.
#
# Why: the numbers in docs/image.md (cold EP=all, then two EP switches on the same buildah
# storage; image footprint; per-backend unique bytes) come from this script, so anyone can
# rerun them. CI profile (TE_BUILD=skip, the big CUDA libraries left out) plus deep-ep: HybridEP's
# git source needs GitHub. Uses the image tests' cached base tarball (run the image tests once
# first) and their uv download cache; removes its storage at the end. Prints BENCH, SIZE and
# UNIQUE lines. EP_IMAGE_TEST_STORAGE_DRIVER=overlay|vfs (default vfs) picks buildah's storage
# driver, as for the image tests.
set -euo pipefail
cd "$(dirname "$0")/.."
cache=${EP_IMAGE_TEST_CACHE:-/var/cache/ep-image-test}
store=$cache/bench
driver=${EP_IMAGE_TEST_STORAGE_DRIVER:-vfs}
trap 'buildah --root "$store/root" --runroot "$store/runroot" --storage-driver "$driver" rmi --all --force >/dev/null 2>&1; rm -rf --one-file-system "$store"' EXIT
export TMPDIR=$store/tmp
mkdir -p "$TMPDIR" && ln -sfn "$cache/buildah-cache" "$TMPDIR/buildah-cache"
B="buildah --root $store/root --runroot $store/runroot --storage-driver $driver"
c=$($B from scratch) && $B add "$c" "$cache"/base-*.tar.gz / \
  && $B config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$c" \
  && $B commit -q "$c" localhost/ep-test-base:bench >/dev/null && $B rm "$c" >/dev/null
# The CI profile's VENV_SKIP_PACKAGES plus deep-ep: HybridEP's git source cannot be cloned here,
# so its stage holds the rest of its venv (torch, cuDNN) without the backend itself.
SKIP="nvidia-cublas nvidia-cufft nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-curand nvidia-nccl-cu13 nvidia-nvshmem-cu13 nvidia-cuda-nvrtc nvidia-cuda-cupti nvidia-nvjitlink nvidia-cufile triton deep-ep"
bud() {  # bud LABEL ARGS...: one timed build
  local label=$1 t0
  shift
  t0=$(date +%s.%N)
  $B bud --isolation chroot --layers --format docker -f docker/Dockerfile \
    --secret id=ca-bundle,src=/etc/ssl/certs/ca-certificates.crt \
    --build-arg BASE_IMAGE=localhost/ep-test-base:bench --build-arg TE_BUILD=skip \
    --build-arg APT_PACKAGES="python3 python3-venv ca-certificates git" \
    --build-arg VENV_SKIP_PACKAGES="$SKIP" "$@" . > "$store/$label.log" 2>&1
  echo "BENCH $label $(python3 -c "import sys; print(round(float(sys.argv[1]) - float(sys.argv[2])))" "$(date +%s.%N)" "$t0") s"
}
# Cold EP=all: venvs-common (every backend's skeleton), the three backend stages, one invocation
# each (bounds the vfs disk peak), then the image.
# The backends and the EP values come from the registry: the default alone, then another one.
mapfile -t names < <(python3 -m ep_image.backends --names)
default=$(python3 -m ep_image.backends --default)
other=$(python3 -c 'import sys; print(next(n for n in sys.argv[2:] if n != sys.argv[1]))' "$default" "${names[@]}")
bud cold-venvs-common --build-arg EP=all --target venvs-common -t bench:venvs-common
for t in "${names[@]/#/ep-}"; do bud "cold-$t" --build-arg EP=all --target "$t" -t "bench:$t"; done
bud cold-all --build-arg EP=all -t bench:all
bud "switch-$default" --build-arg EP="$default" -t "bench:$default"
bud "switch-$other" --build-arg EP="$other" -t "bench:$other"
grep -c "Using cache" "$store"/switch-*.log
grep -h "STEP 1/.*AS " "$store/switch-$default.log" | sed 's/.* AS /visited: /'
python3 - "$store" "$default" "$other" "$driver" <<'PY'
import sys
from pathlib import Path
sys.path.insert(0, "tests")
from _image_storage import image_bytes  # the image tests' reader of the storage's records
root, driver = Path(sys.argv[1]) / "root", sys.argv[4]
default, other = sys.argv[2:4]
sizes = {t: image_bytes(root, driver, t) for t in ("bench:all", f"bench:{default}", f"bench:{other}")}
for t, s in sizes.items():
    print(f"SIZE {t} {s} bytes = {s / 1e9:.3f} GB ({s / sizes[f'bench:{default}']:.4f}x {default})")
PY
ctr=$($B from bench:all)
$B run --isolation chroot "$ctr" -- /usr/bin/python3 - <<'PY'
import os, stat
from pathlib import Path
owners = {}
for venv in sorted(Path("/opt/venvs").iterdir()):
    if venv.is_symlink() or not (venv / "ep-backend.json").is_file():
        continue
    for dirpath, _dirs, files in os.walk(venv):
        for name in files:
            st = os.lstat(os.path.join(dirpath, name))
            if stat.S_ISREG(st.st_mode):
                owners.setdefault(st.st_ino, [st.st_size, set()])[1].add(venv.name)
names = sorted({n for _, s in owners.values() for n in s})
for n in names:
    unique = sum(size for size, who in owners.values() if who == {n})
    print(f"UNIQUE {n} {unique} bytes = {unique / 1e6:.1f} MB")
shared = sum(size for size, who in owners.values() if len(who) > 1)
print(f"SHARED by 2+ venvs {shared} bytes = {shared / 1e9:.3f} GB; total {sum(s for s, _ in owners.values()) / 1e9:.3f} GB")
PY
$B rm "$ctr" >/dev/null
