"""uv's cache of a source build, keyed on what uv does not key on: the build's environment and
declared variables, and the nvcc that compiles it.

``refresh_cache`` drops uv's cached build when such an input changed since the last build, so a
build never takes a wheel compiled from other inputs. Standard library only. See
docs/backends.md, section "Building the git sources".
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

from ep_image.build_steps._source_builds.toolchain import cuda_home

#: Environment inputs of a CUDA extension build that uv does not key on. NVSHMEM_DIR, LDFLAGS
#: and CPATH are left out: make_venv derives them from the venv (``nvshmem``, beside this
#: module), and the venv's temporary name in them changes every build without changing the
#: result.
KEYED_ENVIRONMENT = (
    "TORCH_CUDA_ARCH_LIST",
    "CUDA_HOME",
    "DISABLE_SM90_FEATURES",
    "DISABLE_AGGRESSIVE_PTX_INSTRS",
    "NVCC_APPEND_FLAGS",
    "NVCC_PREPEND_FLAGS",
)
KEY_PREFIX = ".ep-build-key-"


def build_key(env: dict[str, str], variables: dict[str, str]) -> dict[str, str | None]:
    """The inputs that decide the compiled result, beyond the source and the lock."""
    key: dict[str, str | None] = {name: env.get(name) for name in KEYED_ENVIRONMENT}
    key.update({f"declared:{k}": v for k, v in sorted(variables.items())})
    nvcc = cuda_home(env) / "bin" / "nvcc"
    try:
        out = subprocess.run(
            [str(nvcc), "--version"], capture_output=True, text=True, timeout=60, check=False
        ).stdout
        key["nvcc"] = next((line for line in out.splitlines() if "release" in line), out.strip())
    except OSError:
        key["nvcc"] = None
    return key


def key_digest(key: dict[str, str | None]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def uv_cache_dir(uv: str, env: dict[str, str]) -> Path:
    out = subprocess.run(
        [uv, "cache", "dir"], capture_output=True, text=True, env=env, check=True, timeout=60
    )
    return Path(out.stdout.strip())


class CacheError(RuntimeError):
    """uv's cache could not be cleaned; the message names why and the fix."""


def refresh_cache(
    uv: str,
    distribution: str,
    key: dict[str, str | None],
    env: dict[str, str],
    extra: str = "",
    drop_unkeyed: bool = False,
) -> str:
    """Drop ``distribution``'s cached builds if ``key`` differs from the last build of ``extra``.

    Returns what happened: "first" (no key yet), "unchanged", or "changed" (cache cleaned). The
    key is stored in uv's cache directory, so it lives and dies with the builds it describes (an
    image build's cache mount, a host's ~/.cache/uv), one per extra: DeepEP v1, HybridEP and
    DeepEP v2's variant are all ``deep-ep`` (other commits, other inputs), and one record for
    all would see a change at every switch and rebuild each of them every time.
    ``drop_unkeyed``: also drop the cached builds when there is no key yet (state "first").
    """
    cache = uv_cache_dir(uv, env)
    record = cache / f"{KEY_PREFIX}{distribution}{f'-{extra}' if extra else ''}.json"
    digest = key_digest(key)
    previous = None
    if record.is_file():
        try:
            previous = json.loads(record.read_text()).get("sha256")
        except (OSError, ValueError):
            previous = "unreadable"
    state = "first" if previous is None else ("unchanged" if previous == digest else "changed")
    # A build about to be exported must be one of this key: a cached build with no key (a plain
    # `uv sync`'s) may come from other inputs.
    if state == "changed" or (state == "first" and drop_unkeyed):
        # uv waits for every other uv process on this cache (a `uv run` this runs under never
        # ends first): give up after a minute instead of uv's default five.
        clean = subprocess.run(
            [uv, "cache", "clean", distribution], env={"UV_LOCK_TIMEOUT": "60", **env},
            capture_output=True, text=True, timeout=900, check=False,
        )  # fmt: skip
        if clean.returncode != 0:
            raise CacheError(
                f"the build inputs of {distribution} changed since its last build, and "
                f"`uv cache clean {distribution}` failed ({clean.stderr.strip()[-300:]}): uv "
                "waits for other uv processes that use this cache (e.g. a `uv run` this runs "
                "under) and gives up after UV_LOCK_TIMEOUT. Fix: run it outside `uv run`, or "
                "with its own UV_CACHE_DIR"
            )
    cache.mkdir(parents=True, exist_ok=True)
    temp = record.with_suffix(f".tmp{os.getpid()}")
    temp.write_text(json.dumps({"sha256": digest, "key": key}, indent=2, sort_keys=True) + "\n")
    os.replace(temp, record)
    return state
