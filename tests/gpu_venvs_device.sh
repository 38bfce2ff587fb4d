#!/bin/bash
# On the GPU machine, from the repository root: take the parts of tests/gpu_venvs.py's bundle
# that this call carried (.gpu/), check each against SHA256SUMS, and unpack them in order while
# later calls bring the rest (an unpacker started once, in its own session, that outlives the
# call). Ends with one line: parts here, and the unpacker's state.
#   bash tests/gpu_venvs_device.sh receive   each call that carries a part (the first: all of
#                                            .gpu/ but the other parts)
#   bash tests/gpu_venvs_device.sh wait [S]  until the unpacker is done (its exit code), at
#                                            most S seconds (default 600: exit 124 after)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
# Where the parts wait and where the bundle unpacks: the GPU machine's /, or (tests) elsewhere.
store=${EP_GPU_STORE:-/root/ep-gpu}
root=${EP_GPU_ROOT:-/}
carried=${EP_GPU_CARRIED:-$repo/.gpu}
mkdir -p "$store"
unpack() {
  cd "$store" || exit 2
  local want start
  want=$(wc -l < SHA256SUMS)
  start=$(date +%s)
  for i in $(seq 0 $((want - 1))); do
    part=$(printf 'part.%03d' "$i")
    until [ -e "$part.ok" ]; do sleep 0.5; done
    cat "$part" && rm -f "$part"
  done | ./zstd -d --long=27 -q -c | tar -C "$root" --numeric-owner -xpf -
  local rc=$?
  echo "unpack rc=$rc, $(($(date +%s) - start)) s from the first part" > unpack.log
  echo "$rc" > unpack.rc.tmp && mv unpack.rc.tmp unpack.rc
}
case ${1:-} in
  receive)
    shopt -s nullglob
    for f in "$carried"/*; do
      cp -a "$f" "$store/" && rm -f "$f"
    done
    cd "$store"
    for part in part.[0-9][0-9][0-9]; do
      [ -e "$part.ok" ] && continue
      grep " $part\$" SHA256SUMS | sha256sum -c --quiet && touch "$part.ok"
    done
    # The venvs' editable install of the project names the checkout they were built from.
    source_root=$(sed -n 's/.*"source_root": "\(.*\)".*/\1/p' bundle.json)
    if [ -n "$source_root" ] && [ ! -e "$root/$source_root" ]; then
      mkdir -p "$(dirname "$root/$source_root")" && ln -s "$repo" "$root/$source_root"
    fi
    if [ ! -e unpack.started ] && [ -e SHA256SUMS ]; then
      touch unpack.started
      setsid nohup bash "$repo/tests/gpu_venvs_device.sh" unpack > "$store/unpack.out" 2>&1 < /dev/null &
      echo $! > unpack.pid  # its session's leader: whoever must stop it early kills that group
    fi
    state=$( [ -e unpack.rc ] && cat unpack.log || echo "unpacking" )
    echo "parts here: $(find . -name 'part.*.ok' | wc -l) of $(wc -l < SHA256SUMS); $state"
    ;;
  unpack) unpack ;;
  wait)
    deadline=$((SECONDS + ${2:-600}))
    until [ -e "$store/unpack.rc" ]; do
      if [ "$SECONDS" -ge "$deadline" ]; then
        echo "not unpacked after ${2:-600} s: parts here $(find "$store" -name 'part.*.ok' | wc -l)"
        exit 124
      fi
      sleep 0.5
    done
    cat "$store/unpack.log"
    exit "$(cat "$store/unpack.rc")"
    ;;
  *) echo "usage: $0 receive|wait" >&2; exit 2 ;;
esac
