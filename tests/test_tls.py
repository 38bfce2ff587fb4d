"""The host commands behind a TLS-inspecting proxy: uv trusts the machine's trust store, or a
bundle given in SSL_CERT_FILE, not only its own bundled roots.

Real TLS: a package index served here over HTTPS with a certificate of a private CA (as a
company's proxy presents one), that CA added to the system's trust store the way a company
installs it (in a mount namespace of the test's own, over /etc/ssl/certs/ca-certificates.crt,
so nothing else on the machine sees it) or given as a bundle file, and the real uv asked to
install from it.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import os
import shutil
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from _venv_helpers import ROOT, build_wheel

from ep_image.build_steps._uv import trust_store

SYSTEM_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
pytestmark = pytest.mark.skipif(
    shutil.which("openssl") is None or not Path(SYSTEM_BUNDLE).is_file(),
    reason="needs openssl to make the test CA and a system CA bundle",
)


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    """An HTTPS package index on 127.0.0.1 holding one wheel, its certificate signed by a
    private CA; that CA as a bundle and as a trust-store directory."""
    root = tmp_path_factory.mktemp("tls")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=proxy CA",
            "-keyout", "ca.key", "-out", "ca.pem", cwd=root)  # fmt: skip
    (root / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout",
            "server.key", "-out", "server.csr", cwd=root)  # fmt: skip
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-extfile", "san.cnf", "-out", "server.pem",
            cwd=root)  # fmt: skip
    store = root / "ca-certificates.crt"  # the system bundle with the proxy's CA added
    store.write_text(Path(SYSTEM_BUNDLE).read_text() + (root / "ca.pem").read_text())
    site = root / "site"
    wheel = build_wheel(site / "files", "tinypkg", "0.1", {"tinypkg/__init__.py": "X = 1\n"})
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    (site / "simple" / "tinypkg").mkdir(parents=True)
    (site / "simple" / "tinypkg" / "index.html").write_text(
        f'<a href="../../files/{wheel.name}#sha256={digest}">{wheel.name}</a>\n'
    )
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(root / "server.pem", root / "server.key")
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"https://127.0.0.1:{server.server_address[1]}/simple"
    yield {"url": url, "bundle": root / "ca.pem", "store": store, "root": root}
    server.shutdown()


def no_trust(**extra: str) -> dict[str, str]:
    """This environment without any trust setting of its own (what a fresh shell has), plus
    ``extra``; a cache of its own, so nothing comes from an earlier download."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SSL_CERT", "UV_SYSTEM"))}
    env.pop("PIP_CERT", None)
    env.pop("REQUESTS_CA_BUNDLE", None)
    env.pop("NIX_SSL_CERT_FILE", None)
    return {**env, **extra}


def install(index: dict, venv: Path, env: dict[str, str], via_bootstrap: bool, store: bool):
    """``uv pip install`` from the index; ``store``: with the proxy's CA in the system's trust
    store, seen by this command alone (a mount namespace: needs root and unshare)."""
    cmd = ["uv", "pip", "install", "--python", str(venv / "bin" / "python"),
           "--index-url", str(index["url"]), "--no-cache", "tinypkg"]  # fmt: skip
    if via_bootstrap:
        cmd = [sys.executable, str(ROOT / "scripts" / "bootstrap.py"), "--", *cmd]
    if store:
        if os.geteuid() != 0 or shutil.which("unshare") is None:
            pytest.skip("adding a CA to the system's store for one command needs root and unshare")
        bind = f'mount --bind {index["store"]} {SYSTEM_BUNDLE} && exec "$@"'
        cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", bind, "sh", *cmd]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture
def venv(tmp_path: Path) -> Path:
    subprocess.run(["uv", "venv", "-q", str(tmp_path / "venv")], check=True)
    return tmp_path / "venv"


def test_uv_alone_does_not_trust_the_machines_store(index: dict, venv: Path) -> None:
    """The failure users behind such a proxy see: uv's bundled roots lack the proxy's CA."""
    proc = install(index, venv, no_trust(), via_bootstrap=False, store=True)
    assert proc.returncode != 0
    assert "UnknownIssuer" in proc.stderr or "certificate" in proc.stderr.lower(), proc.stderr


def test_the_project_commands_use_the_machines_trust_store(index: dict, venv: Path) -> None:
    proc = install(index, venv, no_trust(), via_bootstrap=True, store=True)
    assert proc.returncode == 0, proc.stderr
    assert "TLS: the system's trust store (UV_SYSTEM_CERTS=1)" in proc.stderr
    assert (next(venv.glob("lib/python3*/site-packages")) / "tinypkg" / "__init__.py").is_file()


def test_a_given_bundle_is_used(index: dict, venv: Path) -> None:
    env = no_trust(SSL_CERT_FILE=str(index["bundle"]))
    proc = install(index, venv, env, via_bootstrap=True, store=False)
    assert proc.returncode == 0, proc.stderr
    assert f"TLS: the CA bundle SSL_CERT_FILE names ({index['bundle']})" in proc.stderr


def test_an_explicit_choice_is_kept() -> None:
    env = {"UV_SYSTEM_CERTS": "0", "SSL_CERT_DIR": "/etc/ssl/certs"}
    assert trust_store.use_system_trust_store(env) == "UV_SYSTEM_CERTS=0 (as set)"
    assert env["UV_SYSTEM_CERTS"] == "0"


def test_the_shell_line_carries_the_trust_choice(index: dict, venv: Path) -> None:
    """README's `eval "$(python3 scripts/bootstrap.py --shell)"`, then a plain uv in that shell:
    it trusts the machine's store as the project's own commands do."""
    uv_line = (
        f"uv pip install --python {venv}/bin/python --index-url {index['url']} --no-cache tinypkg"
    )
    script = f'eval "$({sys.executable} {ROOT}/scripts/bootstrap.py --shell)" && {uv_line}'
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("adding a CA to the system's store for one command needs root and unshare")
    bind = f'mount --bind {index["store"]} {SYSTEM_BUNDLE} && exec sh -c "$0"'
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", bind, script],
        env=no_trust(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (next(venv.glob("lib/python3*/site-packages")) / "tinypkg" / "__init__.py").is_file()


# ---- a CA bundle that is not one -----------------------------------------------------------


def not_a_bundle(tmp_path: Path, kind: str) -> Path:
    """What SSL_CERT_FILE (or the ca-bundle secret) names: an empty file, a directory, text."""
    path = tmp_path / f"bundle-{kind}"
    if kind == "empty":
        path.write_text("")
    elif kind == "directory":
        path.mkdir()
    elif kind == "text":
        path.write_text("this is not a certificate\n")
    else:
        path.write_text("-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydGlmaWNhdGU=\n"
                        "-----END CERTIFICATE-----\n")  # fmt: skip
    return path


@pytest.mark.parametrize("kind", ["empty", "directory", "text", "broken pem"])
def test_bootstrap_refuses_a_bundle_that_is_not_one(tmp_path: Path, kind: str) -> None:
    """Before: bootstrap said it used the bundle and succeeded through the system's
    certificates (Python's ssl ignores an unreadable SSL_CERT_FILE)."""
    bundle = not_a_bundle(tmp_path, kind)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bootstrap.py"), "--", "true"],
        env=no_trust(SSL_CERT_FILE=str(bundle)), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-2].startswith("bootstrap: error: ") and str(bundle) in lines[-2], proc.stderr
    assert lines[-1].startswith("bootstrap: fix: ") and "SSL_CERT_FILE" in lines[-1]
    assert "running: true" not in proc.stderr, "it went on"


def test_make_venv_refuses_an_empty_bundle_before_any_work(tmp_path: Path) -> None:
    """Before: make_venv ran uv, which failed with "UnknownIssuer", and ended with "each error
    above names its fix" while no line named one."""
    bundle = not_a_bundle(tmp_path, "empty")
    proc = subprocess.run(
        [sys.executable, "-m", "ep_image.build_steps.make_venv", "--backend", "deepep_v2",
         "--prefix", str(tmp_path / "venvs")],
        env=no_trust(SSL_CERT_FILE=str(bundle)), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"make_venv: error: SSL_CERT_FILE={bundle} is empty" in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("make_venv: fix: ")
    assert "+ " not in proc.stdout, "it ran a build step first"
    assert not (tmp_path / "venvs" / "deepep_v2").exists()


def with_secrets(tmp_path: Path, bundle: str | None, *command: str):
    """docker/with-secrets as a RUN of an image build runs it: with /run/secrets/ca-bundle
    holding ``bundle`` (None: no secret mounted), in a mount namespace of its own (a tmpfs over
    /run there), so the machine's /run is untouched."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a secret mounted at /run/secrets for one command needs root and unshare")
    secrets = tmp_path / "secrets"
    secrets.mkdir(exist_ok=True)
    setup = "mount -t tmpfs none /run && mkdir /run/secrets"
    if bundle is not None:
        (secrets / "ca-bundle").write_text(bundle)
        setup += f" && cp {secrets / 'ca-bundle'} /run/secrets/ca-bundle"
    script = f'{setup} && exec "$@"'
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
         str(ROOT / "docker" / "with-secrets"), *command],
        env=no_trust(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.parametrize("content", ["", "\n", "not a certificate\n"])
def test_with_secrets_refuses_a_ca_bundle_secret_that_is_not_one(
    tmp_path: Path, content: str
) -> None:
    """Before: an empty secret was ignored without a word, text was exported as the bundle."""
    proc = with_secrets(tmp_path, content, "sh", "-c", "echo ran")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "ran" not in proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "/run/secrets/ca-bundle" in lines[0], proc.stderr
    assert lines[0].startswith("with-secrets: error: ") and "fix:" in lines[0]


def test_with_secrets_exports_a_bundle_and_runs_unchanged_without_one(
    tmp_path: Path, index: dict
) -> None:
    pem = Path(index["bundle"]).read_text()
    shown = with_secrets(tmp_path, pem, "sh", "-c", 'echo "$SSL_CERT_FILE"')
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == "/run/secrets/ca-bundle"
    absent = with_secrets(tmp_path, None, "sh", "-c", 'echo "[$SSL_CERT_FILE]"')
    assert absent.returncode == 0 and absent.stdout.strip() == "[]", absent.stderr
