#!/bin/sh
# assemble.sh: the Dockerfile's `final` stage, in one RUN so that one layer holds the venvs.
#
# Copies the venv of every backend EP selects out of its ep-<backend> stage (bind-mounted at
# /mnt/ep-<backend>), hardlinks identical files across them with scripts/dedup.py *in the same
# layer* (dedup in a later layer would only add to the image), makes the active backend
# /opt/venvs/active, stages the venv's cuDNN ahead of the base image's, and writes the records:
# /opt/venvs/te-build.json (cuDNN TE was built against + the run-time order), dedup.json,
# image.json, env-manifest.json (probes/check_env.py, when the repository has it).
set -eu

prefix=/opt/venvs
mkdir -p "$prefix"
selected=$(select-ep "$EP")
active=$(select-ep --active "$EP" "$EP_ACTIVE")

set --
for backend in $selected; do
    venv=/mnt/ep-$backend/$backend
    if [ ! -f "$venv/ep-backend.json" ]; then
        echo "assemble: stage ep-$backend built no venv for EP=$EP" >&2
        exit 1
    fi
    cp -a "$venv" "$prefix/$backend"
    set -- "$@" "$prefix/$backend"
done
python3 /opt/ep-image/scripts/dedup.py --json "$prefix/dedup.json" "$@"

ln -sf /opt/ep-image/scripts/use-ep /usr/local/bin/use-ep
EP_PREFIX=$prefix use-ep --activate "$active" >/dev/null

python3 /opt/ep-image/docker/stage_cudnn.py --prefix "$prefix" --scripts /opt/ep-image/scripts

if printf '%s\n' "$selected" | grep -qx hybridep; then
    # HybridEP was linked with rpath /opt/nvshmem/nvidia/nvshmem/lib (docker/ep-stage.sh):
    # point that path at the venv's nvidia-nvshmem-cu13, the same version from the same lock.
    mkdir -p /opt/nvshmem/nvidia
    ln -sfn "$(echo "$prefix"/hybridep/lib/python3*/site-packages/nvidia/nvshmem)" \
        /opt/nvshmem/nvidia/nvshmem
fi

python3 - "$prefix" "$EP" "$active" $selected <<'PY'
import json, sys
from pathlib import Path
prefix, ep, active, *selected = sys.argv[1:]
venvs = {b: json.loads((Path(prefix) / b / "ep-backend.json").read_text()) for b in selected}
record = {
    "ep": ep,
    "backends": selected,
    "active": active,
    "switch": "eval \"$(use-ep --activate BACKEND)\", or run with -e EP_BACKEND=BACKEND",
    "skipped_packages": {b: v.get("skipped_packages", []) for b, v in venvs.items()},
}
(Path(prefix) / "image.json").write_text(json.dumps(record, indent=2) + "\n")
PY

probes=/opt/ep-image/probes
if [ -f "$probes/check_env.py" ]; then
    if ! "$prefix/active/bin/python" "$probes/check_env.py" --json "$prefix/env-manifest.json"
    then
        echo "assemble: warning: probes/check_env.py failed; env-manifest.json may be partial" >&2
    fi
else
    echo "assemble: probes/check_env.py not in the build context; no env-manifest.json"
fi
