"""The image tests' Docker client: docker/Dockerfile built with `docker build`, then run.

Why: users type `docker build` and `docker run`; tests/test_image_docker.py holds the image's
promises against a real BuildKit. This module drives one daemon (tests/_docker_engine.py) the
way a user's CLI does, keeps each build's log beside buildah's (<cache>/logs), and reads back
what BuildKit reports (each step DONE or CACHED, by stage) and what dockerd stores (the image's
config, history and layer directories).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from _buildah import CACHE, ROOT, ca_bundle, progress
from _docker_engine import Daemon

_VERTEX = re.compile(r"^#(\d+) (.*)$")
_NAMED = re.compile(r"^\[(\S+)(?: (\d+)/(\d+))?\] (.*)$")


@dataclass
class Step:
    """One BuildKit vertex of a build: ``[stage i/n] INSTRUCTION``, and how it ended."""

    stage: str  # "internal" for BuildKit's own vertices
    instruction: str
    status: str  # DONE, CACHED, ERROR, or "" when the build stopped before it ended


@dataclass
class DockerBuild:
    """One `docker build`: its tag, exit code, plain progress output and wall time."""

    image: str
    returncode: int
    log: list[str]
    seconds: float

    def text(self) -> str:
        return "\n".join(self.log)

    def steps(self) -> list[Step]:
        """Every vertex BuildKit named, in the order it first named them."""
        named: dict[str, Step] = {}
        for line in self.log:
            match = _VERTEX.match(line)
            if not match:
                continue
            vertex, rest = match.groups()
            if vertex not in named:
                label = _NAMED.match(rest)
                if label:
                    named[vertex] = Step(label.group(1), label.group(4), "")
                continue
            word = rest.split(" ", 1)[0].rstrip(":")
            if word in ("DONE", "CACHED", "ERROR"):
                named[vertex].status = word
        return list(named.values())

    def stage_steps(self, stage: str) -> list[Step]:
        return [step for step in self.steps() if step.stage == stage]

    def stages_visited(self) -> list[str]:
        """The stages of which BuildKit ran or looked up at least one step."""
        seen: list[str] = []
        for step in self.steps():
            if step.stage != "internal" and step.stage not in seen:
                seen.append(step.stage)
        return seen

    def runs(self, stage: str) -> list[Step]:
        """The RUN steps of ``stage`` (where a venv is built)."""
        return [s for s in self.stage_steps(stage) if s.instruction.startswith("RUN ")]


def marked_secrets(directory: Path) -> tuple[dict[str, Path], list[str]]:
    """Build secrets carrying markers that must never reach the image: the machine's CA bundle
    with a comment line (PEM readers skip text outside certificates, so TLS still works) and a
    gitconfig whose one insteadOf rule names a host that exists nowhere. Returns the secrets
    (id -> file) and the markers."""
    markers = [f"ep-image-secret-{uuid.uuid4().hex}" for _ in range(2)]
    bundle = directory / "ca-bundle.pem"
    bundle.write_text(ca_bundle().read_text() + f"\n# {markers[0]}\n")
    gitconfig = directory / "gitconfig"
    gitconfig.write_text(
        f'[url "https://{markers[1]}.invalid/"]\n\tinsteadOf = https://example.invalid/\n'
    )
    return {"ca-bundle": bundle, "gitconfig": gitconfig}, markers


class Docker:
    """The docker CLI of one daemon (its socket, its buildx), as a user runs it."""

    def __init__(self, daemon: Daemon, config: pytest.Config | None, label: str = "docker test"):
        self.daemon = daemon
        self.config = config
        self.label = label
        self.logs = CACHE / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    @property
    def cli(self) -> str:
        return str(self.daemon.engine.docker)

    def __call__(
        self, *args: str, check: bool = True, timeout: float = 600, **env: str
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.cli, *args], capture_output=True, text=True, check=check,
                              timeout=timeout, env=self.daemon.env(**env))  # fmt: skip

    def build(
        self,
        image: str,
        build_args: dict[str, str],
        log_name: str,
        context: Path = ROOT,
        dockerfile: Path | None = None,
        secrets: dict[str, Path] | None = None,
        target: str | None = None,
        build_contexts: dict[str, Path] | None = None,
        legacy: bool = False,
    ) -> DockerBuild:
        """docker/Dockerfile (or ``dockerfile``) built as users type it, `docker build`: BuildKit
        through buildx where the engine has it (the CLI runs `docker buildx build`), else the
        engine's own BuildKit (DOCKER_BUILDKIT=1, Docker 20.10); with ``legacy`` the legacy
        builder (DOCKER_BUILDKIT=0). RUN steps use the host network: the daemon has no bridge.
        The output goes to <cache>/logs/docker-<log_name>.log as well, each line with its time."""
        path = dockerfile or context / "docker" / "Dockerfile"
        cmd = [self.cli, "build", "--network=host", "-f", str(path), "-t", image]
        if not legacy:
            cmd.insert(2, "--progress=plain")
            if self.daemon.engine.buildx:
                cmd += ["--allow", "network.host"]  # buildx asks for what the RUNs may use
            for key, file in (secrets or {}).items():
                cmd += ["--secret", f"id={key},src={file}"]
            for name, directory in (build_contexts or {}).items():
                cmd += ["--build-context", f"{name}={directory}"]  # buildx only
        for key, value in build_args.items():
            cmd += ["--build-arg", f"{key}={value}"]
        if target:
            cmd += ["--target", target]
        buildkit = "0" if legacy else "1"
        env = self.daemon.env(DOCKER_BUILDKIT=buildkit)
        log: list[str] = []
        started = time.monotonic()
        with (
            progress(self.config, f"{self.label}: {log_name}") as reporter,
            (self.logs / f"docker-{log_name.replace(':', '-')}.log").open("w") as sink,
        ):
            proc = subprocess.Popen([*cmd, str(context)], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip
            assert proc.stdout is not None
            for line in proc.stdout:
                line = line.rstrip("\n")
                log.append(line)
                sink.write(f"[{time.monotonic() - started:7.1f}s] {line}\n")
                sink.flush()
                if re.match(r"^#\d+ \[\S+ 1/\d+\]", line) or line.startswith("Step "):
                    reporter.say(line[:110])
                elif re.match(r"^#\d+ \[", line):
                    reporter.note(line[:110])
            proc.wait()
        return DockerBuild(image, proc.returncode, log, time.monotonic() - started)

    def run(
        self, image: str, *command: str, env: dict[str, str] | None = None, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        """`docker run --rm IMAGE COMMAND` through the image's entrypoint, on the host network
        (the daemon has no bridge; a container without a network cannot resolve its own
        hostname, which torch's rendezvous needs). Killed when ``timeout`` passes."""
        name = f"ep-image-test-{uuid.uuid4().hex[:12]}"
        flags = [f"--env={key}={value}" for key, value in (env or {}).items()]
        cmd = [self.cli, "run", "--rm", "--name", name, "--network=host", *flags, image, *command]
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                  env=self.daemon.env())  # fmt: skip
        except subprocess.TimeoutExpired:
            self("kill", name, check=False)
            raise

    def inspect(self, image: str) -> dict:
        return json.loads(self("image", "inspect", image).stdout)[0]

    def history(self, image: str) -> str:
        return self("history", "--no-trunc", "--format", "{{.CreatedBy}}", image).stdout

    def size(self, image: str) -> int:
        """Bytes of the image's layers, uncompressed, each once (dockerd's own figure)."""
        return int(self.inspect(image)["Size"])

    def layer_dirs(self, image: str) -> list[Path]:
        """The image's layer directories in dockerd's overlay2 storage, top first; one for each
        entry of its RootFS, or an AssertionError (a scan of them would be incomplete)."""
        info = self.inspect(image)
        data = info["GraphDriver"]["Data"]
        dirs = [data["UpperDir"], *filter(None, data.get("LowerDir", "").split(":"))]
        assert len(dirs) == len(info["RootFS"]["Layers"]), (dirs, info["RootFS"])
        return [Path(d) for d in dirs]

    def import_rootfs(self, tarball: Path, name: str) -> str:
        """A base image from a root file system tarball (`docker import`: no registry)."""
        self("import", "--change", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin"
             ":/sbin:/bin", "--change", 'CMD ["/bin/bash"]', str(tarball), name)  # fmt: skip
        return name


def files_holding(dirs: list[Path], needles: list[str]) -> list[str]:
    """Files under ``dirs`` whose bytes contain any of ``needles`` (grep -rlF)."""
    args = [arg for needle in needles for arg in ("-e", needle)]
    proc = subprocess.run(["grep", "-rlF", *args, *map(str, dirs)], capture_output=True,
                          text=True)  # fmt: skip
    assert proc.returncode in (0, 1), proc.stderr  # 1: nothing found
    return proc.stdout.splitlines()
