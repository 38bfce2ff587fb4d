"""The pinned uv and where the build scripts find it; where they find use-ep.

Why: uv.lock was written by one uv release, and CI, the image and the README install exactly
that one. The version is written here once; ``.ci/run``, ci.yml, the Dockerfile's ``UV_VERSION``
ARG and README repeat it for tools that cannot import Python, and a test holds them equal.
``ep_image/build_steps/bootstrap.py`` installs it where none is on PATH; ``find_uv`` looks there
too, so a command chained after the bootstrap finds it without touching PATH.
"""

from __future__ import annotations

import os
import shutil
import ssl
from pathlib import Path

from ep_image.cli import FixableError

#: The uv that wrote uv.lock.
UV_VERSION = "0.13.9"

#: The active-backend switch: POSIX sh, so that it runs before any Python (host mode, the image).
USE_EP = Path(__file__).resolve().parent.parent / "scripts" / "use-ep"


class ToolError(RuntimeError):
    """A tool is missing; the message says how to install it."""


def bootstrap_dir(version: str = UV_VERSION) -> Path:
    """Where bootstrap.py installs uv: ``$XDG_CACHE_HOME/ep-image/uv-<version>/bin``."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "ep-image" / f"uv-{version}" / "bin"


def find_uv() -> str:
    """uv on PATH, else the one bootstrap.py installed; else ToolError naming the fix."""
    found = shutil.which("uv")
    if found:
        return found
    candidate = bootstrap_dir() / "uv"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    raise ToolError(
        f"uv not found on PATH. Install uv {UV_VERSION}, the version that wrote uv.lock and that "
        "README and CI use: `python3 scripts/bootstrap.py` "
        f"(from PyPI, into {candidate.parent}), "
        f"or `python3 -m pip install uv=={UV_VERSION}`"
    )


#: Where Debian, Ubuntu (and the NGC images) keep the system's CA bundle.
SYSTEM_CA_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt")


def ca_bundle_problem(path: str) -> str | None:
    """Why ``path`` is not a CA bundle OpenSSL can use (None: it is one): missing, not a
    regular file, unreadable, empty, holding no PEM certificate, or one OpenSSL cannot read."""
    bundle = Path(path)
    if bundle.is_dir():
        return "is a directory, not a bundle file (a directory of certificates is SSL_CERT_DIR)"
    if not bundle.exists():
        return "does not exist"
    if not bundle.is_file():
        return "is not a regular file"
    try:
        data = bundle.read_bytes()
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if not data.strip():
        return "is empty"
    if b"-----BEGIN CERTIFICATE-----" not in data:
        return "holds no PEM certificate (no '-----BEGIN CERTIFICATE-----' line)"
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=path)
    except (ssl.SSLError, ValueError) as exc:
        return f"holds a certificate OpenSSL cannot read ({getattr(exc, 'reason', None) or exc})"
    return None


def use_system_trust_store(env: dict[str, str] | None = None) -> str:
    """Make the uv this process runs trust what the machine trusts, and say which store.

    uv trusts its own bundled roots by default, so behind a TLS-inspecting proxy (whose CA is in
    the system's store, as a company installs it) every download fails with "invalid peer
    certificate: UnknownIssuer". A bundle given in SSL_CERT_FILE is used as it is (by uv and by
    Python); else, where the system has a store and UV_SYSTEM_CERTS is not set, it is turned on.
    ``env``: the environment to adjust (default this process's, which children inherit).
    A bundle that is not one (empty, a directory, no PEM certificate) is a FixableError naming
    it, raised before anything runs.
    """
    env = os.environ if env is None else env  # type: ignore[assignment]
    if env.get("SSL_CERT_FILE"):
        bundle = env["SSL_CERT_FILE"]
        if (why := ca_bundle_problem(bundle)) is not None:
            # Python's ssl ignores such a file and trusts the system's store; uv trusts nothing
            # then: refused here, before either runs, naming the file.
            raise FixableError(
                f"SSL_CERT_FILE={bundle} {why}, so nothing could be trusted through it",
                "point SSL_CERT_FILE at a PEM CA bundle (the file holding your proxy's CA "
                "certificate, e.g. /etc/ssl/certs/ca-certificates.crt with it added), or unset "
                "it to use the system's trust store",
            )
        return f"the CA bundle SSL_CERT_FILE names ({bundle})"
    if "UV_SYSTEM_CERTS" in env:
        return f"UV_SYSTEM_CERTS={env['UV_SYSTEM_CERTS']} (as set)"
    if env.get("SSL_CERT_DIR") or any(Path(b).is_file() for b in SYSTEM_CA_BUNDLES):
        env["UV_SYSTEM_CERTS"] = "1"
        return "the system's trust store (UV_SYSTEM_CERTS=1)"
    return "uv's bundled roots (no system trust store here)"
