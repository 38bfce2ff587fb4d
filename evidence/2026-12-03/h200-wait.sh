#!/bin/bash
# On the H200 machine: wait (at most SECONDS) until every named flag file exists in /tmp/r or
# /tmp/bg, then bring back the reports so far, the background builds' logs and statuses.
seconds=${1:?seconds}
shift
end=$(( $(date +%s) + seconds ))
for flag in "$@"; do
  while [ ! -e "/tmp/r/$flag" ] && [ ! -e "/tmp/bg/$flag" ] && [ "$(date +%s)" -lt "$end" ]; do
    sleep 5
  done
done
out=${OUT:-/tmp/out}
mkdir -p "$out"
tar -C /tmp -czf "$out/reports.tar.gz" r bg 2>/dev/null
cat /tmp/r/summary.txt 2>/dev/null
for s in /tmp/bg/*.status; do [ -e "$s" ] && echo "$(basename "$s"): $(cat "$s")"; done
tail -n 3 /tmp/bg/hybridep.log /tmp/bg/te.log 2>/dev/null | cut -c1-300
