#!/usr/bin/env bash
# Reruns this page's figures from the repository as committed: the image benchmark
# (tests/bench_image.py) with buildah, with Docker 26 and buildx (Debian 13's packages) and with
# Debian 12's Docker 20.10 (its built-in BuildKit), one after the other on this machine. Each
# prints BENCH (seconds per build), CACHED/RAN (what an EP switch reused and ran) and SIZE lines.
# As root; from any directory; the builders to run may be named as arguments (default: all
# three). OUT (default: a new directory under /tmp) receives
# bench-<builder>.txt (the figures), bench-<builder>.log (the progress lines) and machine.txt
# (commit, date, CPUs, kernel, and the load average before and after each builder).
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
out=${OUT:-$(mktemp -d /tmp/bench-image.XXXXXX)}
mkdir -p "$out"
cd "$repo"
{
  echo "commit $(git rev-parse HEAD)$(git diff --quiet HEAD || echo ' + uncommitted changes')"
  echo "date $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "cpus $(nproc); kernel $(uname -r); memory $(free -g | awk '/^Mem/ {print $2}') GiB"
} > "$out/machine.txt"
builders=("$@")
[ ${#builders[@]} -gt 0 ] || builders=(buildah docker docker-20.10)
for builder in "${builders[@]}"; do
  echo "load before $builder: $(cut -d' ' -f1-3 /proc/loadavg)" >> "$out/machine.txt"
  start=$SECONDS
  python3 scripts/bootstrap.py -- uv run --frozen --group dev python3 tests/bench_image.py \
    --builder "$builder" > "$out/bench-$builder.txt" 2> "$out/bench-$builder.log"
  # The logs name the test cache's directories; the page calls it <cache>.
  sed -i "s|${EP_IMAGE_TEST_CACHE:-/var/cache/ep-image-test}|<cache>|g" "$out/bench-$builder.log"
  echo "load after $builder: $(cut -d' ' -f1-3 /proc/loadavg); $((SECONDS - start)) s in all" \
    >> "$out/machine.txt"
done
echo "figures in $out"
