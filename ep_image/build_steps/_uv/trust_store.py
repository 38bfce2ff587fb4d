"""What the uv the build steps run trusts: the machine's CA store, or the bundle SSL_CERT_FILE
names, checked before anything runs.

Why: uv trusts its own bundled roots by default, so behind a TLS-inspecting proxy (whose CA is
in the system's store) every download fails; a bundle that is not one makes uv trust nothing.
Standard library only.
"""

from __future__ import annotations

import os
import ssl
from pathlib import Path

from ep_image.cli import FixableError

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
