#!/usr/bin/env bash
# Run one command inside the EP image on a GPU runner, with one backend's venv active.
#
# Why a script: gpu-probes.yml runs three probes per backend with the same container flags;
# keeping the flags in one place means the probes cannot run under different conditions.
# Usage (from the repository root of a checkout of the image's commit):
#   IMAGE=ghcr.io/o/r:all-<sha> BACKEND=hybridep bash .github/scripts/in-image.sh CMD [ARG ...]
# The command runs from the image's WORKDIR (/opt/ep-image), so `probes/check_ep.py` is the
# image's own, as a user types it; ./reports is mounted at /out for the JSON reports.
#
# NVLink multicast (NVLS) is off unless ALLOW_NVLS=true: a program that uses it on a host
# whose GPUs are shared can take them out of service. The probes test correctness, not peak
# bandwidth, so nothing they check needs it.
set -euo pipefail

: "${IMAGE:?set IMAGE to the image reference to run}"
: "${BACKEND:?set BACKEND to the backend whose venv to activate (python3 -m ep_image.backends --names)}"
[ "$#" -gt 0 ] || { echo "usage: in-image.sh CMD [ARG ...]" >&2; exit 2; }

mkdir -p reports
flags=(
  --rm --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864
  -e PYTHONDONTWRITEBYTECODE=1
  -v "$PWD/reports:/out"
)
if [ "${ALLOW_NVLS:-false}" != true ]; then
  flags+=(-e NCCL_NVLS_ENABLE=0 -e NVSHMEM_DISABLE_NVLS=1 -e TORCH_SYMM_MEM_DISABLE_MULTICAST=1)
fi

# EP_BACKEND is the image's own switch: its entrypoint (docker/ep-entrypoint) activates
# /opt/venvs/$EP_BACKEND through use-ep and fails if the image does not hold that backend, so
# a probe never runs silently in another backend's venv. This is the path users take too.
# A container cannot see which image it runs: the reports name it from EP_IMAGE_REF, the
# reference with the digest the runner pulled (docs/probes.md, JSON reports).
ref=$(docker image inspect --format '{{index .RepoDigests 0}}' "$IMAGE" 2>/dev/null || echo "$IMAGE")
exec docker run "${flags[@]}" -e EP_BACKEND="$BACKEND" -e EP_IMAGE_REF="$ref" "$IMAGE" "$@"
