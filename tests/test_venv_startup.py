"""venv_startup/: what every venv of the project runs at interpreter start (its ``.pth``).

The real install is tested where venvs are made (tests/test_uv_sync.py, tests/test_ncclep.py);
here, each rule of the default on its own, in a fresh interpreter so this one keeps its
environment.
"""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STARTUP = ROOT / "venv_startup"
VARIABLE = "NCCL_EP_JIT_CACHE_DIR"


def cache_dir(**env: str) -> str | None:
    """NCCL_EP_JIT_CACHE_DIR after the startup module ran with ``env`` (None: unset)."""
    base = {k: v for k, v in os.environ.items() if k not in (VARIABLE, "XDG_CACHE_HOME")}
    code = (
        f"import sys; sys.path.insert(0, {str(STARTUP)!r}); import ep_image_jit_cache, os; "
        f"print(repr(os.environ.get({VARIABLE!r})))"
    )
    proc = subprocess.run(
        [sys.executable, "-S", "-c", code],
        capture_output=True, text=True, timeout=60, check=True, env={**base, **env},
    )  # fmt: skip
    return eval(proc.stdout)  # the repr of a str or None, printed by our own child


def test_unset_becomes_the_users_own_cache_under_the_passwd_home() -> None:
    home = pwd.getpwuid(os.getuid()).pw_dir
    # $HOME is not trusted for it: a launcher may point it at a shared directory.
    assert cache_dir(HOME="/tmp") == os.path.join(home, ".cache", "nccl_ep", "jit")


def test_xdg_cache_home_is_followed() -> None:
    assert cache_dir(XDG_CACHE_HOME="/srv/me/cache") == "/srv/me/cache/nccl_ep/jit"


def test_a_value_already_set_is_kept_even_empty() -> None:
    assert cache_dir(NCCL_EP_JIT_CACHE_DIR="/scratch/jit") == "/scratch/jit"
    assert cache_dir(NCCL_EP_JIT_CACHE_DIR="") == ""


def test_the_pth_imports_the_module_and_the_wheel_ships_both() -> None:
    assert (STARTUP / "ep_image_jit_cache.pth").read_text() == "import ep_image_jit_cache\n"
    text = (ROOT / "pyproject.toml").read_text()
    assert 'data = { purelib = "venv_startup" }' in text
