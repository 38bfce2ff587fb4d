#!/bin/sh
# build_host.sh: host mode, for clusters without Docker (enroot, Apptainer, plain Slurm nodes).
#
# The work is ep_image/build_steps/build_host.py (ep_image.build_steps.make_venv for each backend, dedup across
# them, use-ep; `build_host.sh --help`, docs/host-mode.md). This finds a Python >= 3.11 to run
# it: $PYTHON, else python3 when new enough (a cluster's is often older), else uv's.
set -eu

root=$(cd "$(dirname "$0")/.." && pwd)
# The checkout's ep_image package, not installed in the Python that runs it.
PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
# What the user ran, for the usage line and messages of the Python behind it.
EP_IMAGE_DOOR=build_host.sh
export PYTHONPATH EP_IMAGE_DOOR

if [ -n "${PYTHON:-}" ]; then
    exec "$PYTHON" -m ep_image.build_steps.build_host "$@"
elif python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    exec python3 -m ep_image.build_steps.build_host "$@"
elif command -v uv >/dev/null; then
    exec uv run --no-project --python '>=3.11' python -m ep_image.build_steps.build_host "$@"
fi
echo "build_host.sh: needs Python >= 3.11, or uv to fetch one: python3 scripts/bootstrap.py" >&2
exit 1
