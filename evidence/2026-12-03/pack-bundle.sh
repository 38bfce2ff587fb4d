#!/bin/bash
# On the CPU build machine (with network): what the H200 machine (no network) needs to make the
# venvs itself, offline, with scripts/make_venv.py from uv.lock, in parts of one device call
# each. The venvs were first made here with make_venv.py (Python 3.12, TORCH_CUDA_ARCH_LIST=9.0)
# into the uv cache CACHE, so it holds every wheel and the source builds of DeepEP v1 and the
# pinned v2. The bundle:
#   uv/        that cache's wheels, built wheels and git database; the git checkouts cleaned of
#              build outputs (HybridEP is compiled on the H200)
#   bin/uv     the pinned uv (scripts/bootstrap.py installs the same from PyPI)
#   mirrors/   bare git mirrors of DeepEP and NVIDIA/nccl (HybridEP's submodule)
#   src/       each pinned DeepEP commit's tests/ (the upstream tests: the oracles)
#   te-src/    TransformerEngine at the pinned commit with its submodules, without tests/docs
set -euo pipefail
cache=${1:?uv cache} mirrors=${2:?git mirrors} tests=${3:?upstream tests} te=${4:?TE source}
bundle=${5:?bundle directory} out=${6:?output directory for the parts}
mkdir -p "$bundle/uv/git-v2" "$bundle/bin" "$bundle/mirrors" "$out"
cp -al "$cache"/archive-v0 "$cache"/wheels-v8 "$cache"/sdists-v11 "$cache"/simple-v28 \
  "$cache"/CACHEDIR.TAG "$bundle/uv/"
cp -a "$cache"/git-v2/db "$cache"/git-v2/checkouts "$bundle/uv/git-v2/"
for checkout in "$bundle"/uv/git-v2/checkouts/*/*/; do
  git -C "$checkout" clean -xdffq
  git -C "$checkout" submodule foreach --quiet --recursive git clean -xdffq
done
cp "$(command -v uv)" "$bundle/bin/"
cp -a "$mirrors"/DeepEP.git "$mirrors"/nccl.git "$bundle/mirrors/"
cp -a "$tests" "$bundle/src"
mkdir -p "$bundle/te-src"
tar -C "$te" --exclude=./build --exclude=.git --exclude=./docs --exclude=./tests \
  --exclude=./examples --exclude=./benchmarks --exclude=./qa \
  --exclude=./3rdparty/cutlass/docs --exclude=./3rdparty/cutlass/test \
  --exclude=./3rdparty/cutlass/examples --exclude=./3rdparty/cutlass/media \
  --exclude=./3rdparty/cutlass/python --exclude=./3rdparty/cutlass/tools/profiler \
  --exclude=./3rdparty/cutlass/tools/library -cf - . | tar -C "$bundle/te-src" -xf -
# 5.6 GB in, 2.6 GB out, in 196 s on 2 cores; 60 MiB parts leave room for the repository in a
# call's 64 MiB.
tar -C "$bundle" -cf - . | zstd -12 -T2 --long=27 -q -c | split -b 60M -d -a 3 - "$out/p"
(cd "$out" && sha256sum p[0-9]* > SHA256SUMS)
cp "$(command -v zstd)" "$out/zstd"
ls -la "$out"
