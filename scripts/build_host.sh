#!/bin/sh
# build_host.sh: host mode, for clusters without Docker (enroot, Apptainer, plain Slurm nodes).
#
# Why: the image builds one venv per EP backend and hardlinks their identical files; a cluster
# user who cannot run Docker needs the same result in a directory they own, from the same lock
# and the same scripts, so the image and the host never drift. This builds every requested
# backend with ep_image/build/make_venv.py (each atomically, under <prefix>/<backend>), then runs
# ep_image/build/dedup.py across them, then says how to switch backend with scripts/use-ep.
# docs/host-mode.md is the guide.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
# The checkout's ep_image package, not installed in the Python that runs the steps.
PYTHONPATH=$(dirname "$here")${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH
prefix=${EP_PREFIX:-}
backends=${EP_BACKENDS:-all}
venv_python=
project=
read_only=--read-only
activate=
te_args=

usage() {
    cat <<EOF
usage: build_host.sh --prefix DIR [--backends LIST] [--te-wheel PATH]... [--python PY]
                     [--project DIR] [--no-read-only] [--activate BACKEND]

Build EP backend venvs under DIR (one per backend, from the committed uv.lock), then hardlink
identical files across them, so all of them cost about as much disk as one.

  --prefix DIR        where the venvs go (default: \$EP_PREFIX); use a filesystem that
                      supports hardlinks, and the same one for all backends
  --backends LIST     comma list of backends (ep_image/backends.py --names), or all
                      (default: \$EP_BACKENDS or all); a backend that fails does not stop the others
  --te-wheel PATH     Transformer Engine wheel from ep_image/build/build_te.py, put in every venv
  --python PY         interpreter for the venvs (uv venv --python; uv may download one)
  --project DIR       the pyproject.toml + uv.lock to build from (default: this repository)
  --no-read-only      keep write bits on shared files (default: dedup --read-only, so an
                      in-place write into one venv fails instead of changing all of them;
                      see docs/host-mode.md)
  --activate BACKEND  point DIR/active at BACKEND when done

Exit codes: 0 all built; 1 a backend failed (the others are built and deduplicated); 2 usage.
Needs: uv (on PATH, or installed by python3 -m ep_image.build.bootstrap), Python >= 3.11 to run the
scripts (PYTHON=..., else python3, else uv's). Every step is ep_image/build/make_venv.py, the command
the image's ep-<backend> stages run too: HybridEP's NVSHMEM set-up included.
EOF
}

while [ $# -gt 0 ]; do
    case $1 in
        --prefix) prefix=${2:?--prefix needs DIR}; shift 2 ;;
        --backends) backends=${2:?--backends needs LIST}; shift 2 ;;
        --te-wheel) te_args="$te_args --te-wheel=${2:?--te-wheel needs PATH}"; shift 2 ;;
        --python) venv_python=${2:?--python needs PY}; shift 2 ;;
        --project) project=${2:?--project needs DIR}; shift 2 ;;
        --read-only) read_only=--read-only; shift ;;
        --no-read-only) read_only=; shift ;;
        --activate) activate=${2:?--activate needs BACKEND}; shift 2 ;;
        -h | --help) usage; exit 0 ;;
        *) printf 'build_host.sh: unknown argument %s\n' "$1" >&2; usage >&2; exit 2 ;;
    esac
done
if [ -z "$prefix" ]; then
    echo "build_host.sh: --prefix DIR (or EP_PREFIX) is required" >&2
    exit 2
fi
mkdir -p "$prefix"
prefix=$(cd "$prefix" && pwd)
# The scripts need Python >= 3.11 (tomllib); a cluster's python3 is often older.
py() {
    if [ -n "${PYTHON:-}" ]; then
        "$PYTHON" "$@"
    elif python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
        python3 "$@"
    elif command -v uv >/dev/null; then
        uv run --no-project --python '>=3.11' python "$@"
    else
        echo "build_host.sh: needs Python >= 3.11, or uv to fetch one: python3 -m ep_image.build.bootstrap" >&2
        exit 1
    fi
}

# Copies, not links into uv's cache: the prefix then stands alone (the cache may be on another
# filesystem, be pruned, or belong to someone else), and dedup.py does the sharing, within it.
UV_LINK_MODE=${UV_LINK_MODE:-copy}
export UV_LINK_MODE

status=0
# shellcheck disable=SC2086  # te_args is a list of --te-wheel=PATH words
py -m ep_image.build.make_venv --backend "$backends" --prefix "$prefix" --keep-going \
    ${venv_python:+--python "$venv_python"} ${project:+--project "$project"} $te_args || status=$?

venvs=$(EP_PREFIX=$prefix "$here/use-ep" --list)
count=$(printf '%s\n' "$venvs" | grep -c . || true)
if [ "$count" -ge 2 ]; then
    # shellcheck disable=SC2086  # one word per backend name
    (cd "$prefix" && py -m ep_image.build.dedup $read_only --json "$prefix/dedup.json" $venvs) ||
        status=1
fi
if [ -n "$activate" ]; then
    EP_PREFIX=$prefix "$here/use-ep" --activate "$activate" >/dev/null || status=1
fi

printf 'build_host.sh: backends under %s: %s\n' "$prefix" "$(printf '%s\n' "$venvs" | paste -s -d ' ' -)"
echo "build_host.sh: switch with: eval \"\$(EP_PREFIX=$prefix $here/use-ep BACKEND)\""
exit "$status"
