"""Point NCCL EP's JIT kernel cache at this user's own directory when nothing else did.

Why: nccl-extensions compiles its kernels into ``/tmp/nccl_ep/jit`` unless
``NCCL_EP_JIT_CACHE_DIR`` is set, a directory any user of the machine can create first and fill
with kernels that then run in every job. Every venv that holds this project (make_venv's, the
image's, ``uv sync``'s) runs this at interpreter start through the ``.pth`` file beside it, so
training processes get a private default too; a value the user or the image set is kept (and the
probes still check it). Standard library only; nothing is created here (the library makes the
directory when it first compiles).
"""

from __future__ import annotations

import os
import pwd
from collections.abc import MutableMapping

VARIABLE = "NCCL_EP_JIT_CACHE_DIR"


def default_dir(env: MutableMapping[str, str]) -> str | None:
    """``$XDG_CACHE_HOME/nccl_ep/jit``, else under the passwd entry's home (not ``$HOME``,
    which a launcher may point at a shared directory); None for a uid without an entry."""
    base = env.get("XDG_CACHE_HOME")
    if not base:
        try:
            base = os.path.join(pwd.getpwuid(os.getuid()).pw_dir, ".cache")
        except KeyError:
            return None
    return os.path.join(base, "nccl_ep", "jit")


def apply(env: MutableMapping[str, str] = os.environ) -> None:
    """Set the variable unless it is set (to anything, empty included: that is the user's);
    without a home to put it in, the library's default stays and the probes name it."""
    if VARIABLE not in env and (where := default_dir(env)) is not None:
        env[VARIABLE] = where


apply()
