"""docker/Dockerfile built and run with a real Docker Engine and BuildKit, as users type it.

What this proves, with dockerd and buildx from Debian's packages (tests/_docker_engine.py), one
daemon for the module, its state under the run's temporary directory:
- Docker's legacy builder (DOCKER_BUILDKIT=0, or a docker CLI without buildx) stops at the
  Dockerfile's first stage with one line naming the oldest Docker and the fix, after sending a
  build context that the root .dockerignore keeps small; the .dockerignore keeps what the main
  job and the tests write (venvs/, reports/, .venv, caches) out of any build context;
- an unknown EP fails at once, BuildKit quoting the Dockerfile line that lists the valid values;
- EP=deepep_v2 builds from an empty cache (the stages EP does not select never run), then EP=all
  from its cache: base, venvs-common and ep-deepep_v2 CACHED, no backend venv built twice, then
  EP=deepep_v2 again, every step CACHED;
- EP=all holds every backend, torch one inode across the venvs, `-e EP_BACKEND=` switches the
  venv (an unknown one is refused), at most 1.03x the one-backend image;
- the build secrets (a CA bundle and a gitconfig, each with a marker) reach the build and
  nothing else: no layer file, `docker history` line or image config holds a marker (and the
  scan does find a marker that a build leaks on purpose);
- inside the image, `docker run --rm IMAGE probes/...` passes for each command of
  PROBE_COMMANDS (check_ep and check_train over gloo on 2 ranks, check_env; see below for the
  profile);
- PREBUILT_WHEELS: a source-built backend's wheel, exported by make_venv in the image's own
  environment, is taken instead of compiling, both from a directory outside the build context
  (`--build-context prebuilt-wheels=DIR`) and from one inside it (`--build-arg
  PREBUILT_WHEELS=DIR`), with no route to the git source.

The builds use the buildah tests' CI profile (tests/test_image_build.py says what it leaves
out). torch needs the CUDA libraries that profile leaves out to import at all, so the probes
run in the EP=all image with those libraries added back into its active venv: one RUN of `uv
sync --inexact` from the image's own lock, the versions a full image holds. Where the engine
cannot be fetched or started the tests skip, saying why; with EP_IMAGE_TEST_REQUIRE_DOCKER=1
(.ci/run sets it) they fail instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import fake_hybridep
import pytest
from _buildah import (
    LEFT_OUT,
    base_rootfs_tar,
    build_args,
    recipe_key,
    sigterm_as_ctrl_c,
    store_parent,
)
from _docker import Docker, DockerBuild, files_holding, marked_secrets
from _docker_engine import Daemon, EngineUnavailable, install, running
from _progress import Progress
from test_source_build import fake_cuda, rdma_home

from ep_image import backends, pins
from ep_image.build_steps._source_builds import nvshmem
from ep_image.repo import dockerfile

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
REQUIRE = "EP_IMAGE_TEST_REQUIRE_DOCKER"
SINGLE_EP = backends.DEFAULT_BACKEND
MULTI_EP = "all"
VALUES = ", ".join(value for value, _ in backends.image_ep_values())
LEGACY_LINE = "docker/Dockerfile needs BuildKit (Docker 20.10 or newer)"

#: What `docker run --rm IMAGE ...` must pass inside the EP=all image, and a line its output
#: must hold. One entry per probe: adding a probe is adding a line.
PROBE_COMMANDS = [
    pytest.param(
        ["probes/check_ep.py", "--backend", "torch", "--nproc-per-node", "2"],
        "result: passed (exit 0)",
        id="check_ep",
    ),
    pytest.param(["probes/check_env.py"], f"EP_BACKEND          {SINGLE_EP}", id="check_env"),
    pytest.param(
        ["probes/check_train.py", "--backend", "torch", "--nproc-per-node", "2"],
        "result: passed (exit 0)",
        id="check_train",
    ),
]


# --- fast checks (no daemon) -----------------------------------------------------------------


def test_the_legacy_builder_stage_comes_first_and_nothing_needs_it() -> None:
    """Docker's legacy builder builds every stage in file order, so the stage that stops it must
    be the first; BuildKit and buildah build only what `final` reaches, so no stage may use it."""
    text = DOCKERFILE.read_text()
    stages = re.findall(r"^FROM \S+ AS (\S+)$", text, re.MULTILINE)
    assert stages[0] == "legacy-builder", stages[:3]
    body = text.split("AS legacy-builder\n", 1)[1].split("\nFROM ", 1)[0]
    assert LEGACY_LINE in body and "exit 1" in body
    assert "legacy-builder" not in text.split("AS legacy-builder\n", 1)[1]


def test_no_mount_source_needs_a_build_arg() -> None:
    """Docker 20.10's frontend does not expand ARGs in RUN --mount options (it failed with
    `"/${PREBUILT_WHEELS}" not found`): every mount names a fixed path or a stage."""
    mounts = re.findall(r"--mount=(\S+)", DOCKERFILE.read_text())
    assert mounts and not [m for m in mounts if "$" in m], mounts


def test_the_ep_values_above_final_are_the_registrys() -> None:
    lines = DOCKERFILE.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.endswith(" AS final"))
    assert lines[at - 2] == dockerfile.ep_values_line() == f"# valid EP values: {VALUES}"


# --- the daemon --------------------------------------------------------------------------------


def unavailable(reason: str) -> None:
    if os.environ.get(REQUIRE) == "1":
        pytest.fail(f"the Docker tests cannot run: {reason} ({REQUIRE}=1: they must run here)")
    pytest.skip(f"no Docker engine: {reason}")


def announce(config: pytest.Config, lines: list[str]) -> None:
    capture = config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print()
        for line in lines:
            print(f"  [docker test] {line}")


@pytest.fixture(scope="module")
def docker(pytestconfig: pytest.Config) -> Iterator[Docker]:
    """One dockerd for the module, its state under EP_IMAGE_TEST_STORE_PARENT (.ci/run's run
    directory) or the test cache; stopped by its PID at the end, also on failure or SIGTERM."""
    stack = contextlib.ExitStack()
    try:
        with Progress(pytestconfig, "docker test: engine") as progress:
            progress.say("Debian's docker.io, docker-cli, docker-buildx, containerd, runc")
            engine = install()
            stack.enter_context(sigterm_as_ctrl_c())
            daemon: Daemon = stack.enter_context(running(engine, store_parent()))
    except EngineUnavailable as error:
        stack.close()
        unavailable(str(error))
    with stack:
        versions = ", ".join(f"{k} {v}" for k, v in sorted(engine.versions.items()))
        announce(pytestconfig, [f"dockerd pid {daemon.pid}, state {daemon.state}", versions])
        yield Docker(daemon, pytestconfig)


@pytest.fixture(scope="module")
def base_image(docker: Docker, pytestconfig: pytest.Config) -> str:
    """The image tests' Debian base (tests/_buildah.py), imported from its cached tarball."""
    with Progress(pytestconfig, "docker test: base image") as progress:
        progress.say("debootstrap (first run only) and docker import")
        return docker.import_rootfs(base_rootfs_tar(), f"ep-test-base:{recipe_key()}")


@pytest.fixture(scope="module")
def secrets(docker: Docker) -> tuple[dict[str, Path], list[str]]:
    """In the daemon's state directory, not pytest's: they go with it, also when the next run
    removes what a killed run left (tests/_owned_dirs.py)."""
    return marked_secrets(docker.daemon.secrets)


@dataclass
class Builds:
    """EP=deepep_v2 from an empty cache, then EP=all, then EP=deepep_v2 again."""

    single: DockerBuild
    multi: DockerBuild
    again: DockerBuild


@pytest.fixture(scope="module")
def builds(docker: Docker, base_image: str, secrets: tuple[dict[str, Path], list[str]]) -> Builds:
    files, _markers = secrets
    done = []
    for ep, tag in ((SINGLE_EP, "single"), (MULTI_EP, "multi"), (SINGLE_EP, "again")):
        build = docker.build(f"ep-image:{tag}", build_args(base_image, ep), tag, secrets=files)
        assert build.returncode == 0, build.text()[-6000:]
        done.append(build)
    return Builds(*done)


# --- builders that cannot build the file; the build context -----------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("how", ["DOCKER_BUILDKIT=0", "no buildx"])
def test_a_builder_without_buildkit_stops_first_with_the_fix(
    docker: Docker, base_image: str, how: str, tmp_path: Path, pytestconfig: pytest.Config
) -> None:
    """The legacy builder, chosen (DOCKER_BUILDKIT=0) or the only one a CLI without buildx has,
    on this checkout (whose .venv alone is gigabytes): a small context, then one line with the
    fix at the first stage, never a mount error."""
    if how == "no buildx":
        (tmp_path / "cli-plugins").mkdir()  # a client configuration without the plugin
        env = docker.daemon.env(DOCKER_CONFIG=str(tmp_path))
        cmd = [docker.cli, "build", "--network=host", "-f", str(DOCKERFILE),
               "--build-arg", f"BASE_IMAGE={base_image}", str(ROOT)]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        returncode, text = proc.returncode, proc.stdout + proc.stderr
    else:
        build = docker.build("ep-image:legacy", {"BASE_IMAGE": base_image}, "legacy", legacy=True)
        returncode, text = build.returncode, build.text()
    assert returncode != 0, text[-3000:]
    if how == "no buildx" and "buildx component is missing" in text:
        # A CLI that refuses rather than falling back: its own line names the fix.
        assert "install" in text.lower(), text[-2000:]
        announce(pytestconfig, [f"{how}: the CLI refuses: {text.strip().splitlines()[-1]}"])
        return
    assert f"{LEGACY_LINE}: this is Docker's legacy builder" in text, text[-3000:]
    assert "install buildx" in text
    assert "not found" not in text and "--mount option requires BuildKit" not in text
    sent = re.search(r"Sending build context to Docker daemon\s+([\d.]+)([kMG]?B)", text)
    assert sent, text[:2000]
    size = float(sent.group(1)) * {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}[sent.group(2)]
    assert size < 20e6, f"the legacy builder was sent {sent.group(0)}"
    announce(pytestconfig, [f"{how}: legacy builder, context {sent.group(1)} {sent.group(2)}, "
                            f"stopped at the first stage: {LEGACY_LINE}: ..."])  # fmt: skip


@pytest.mark.slow
def test_the_dockerignore_keeps_what_jobs_write_out_of_the_context(
    docker: Docker, tmp_path: Path
) -> None:
    """BuildKit sends a `COPY . /ctx/` build the context the root .dockerignore leaves: the
    repository's files with what the main job and the tests write planted beside them."""
    context = tmp_path / "context"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, check=True).stdout.decode()  # fmt: skip
    for name in filter(None, files.split("\0")):
        if (ROOT / name).is_file():
            (context / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, context / name)
    planted = ["venvs/deepep_v2/bin/python", "reports/check_ep.json", ".venv/pyvenv.cfg",
               ".pytest_cache/v/cache/lastfailed", ".ruff_cache/CACHEDIR.TAG",
               "ep_image/__pycache__/cli.cpython-311.pyc", "probes/check_ep.pyc"]  # fmt: skip
    for name in planted:
        (context / name).parent.mkdir(parents=True, exist_ok=True)
        (context / name).write_text("written by a job\n")
    probe = tmp_path / "context-probe.Dockerfile"
    probe.write_text("FROM scratch\nCOPY . /ctx/\n")
    out = tmp_path / "out"
    proc = docker("buildx", "build", "--progress=plain", "-f", str(probe), "--output",
                  f"type=local,dest={out}", str(context), check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kept = {str(p.relative_to(out / "ctx")) for p in (out / "ctx").rglob("*") if p.is_file()}
    assert not [name for name in planted if name in kept], sorted(kept)[:50]
    needed = ["pyproject.toml", "uv.lock", "ep_image/__init__.py", "ep_image/backends/__init__.py",
              "probes/check_ep.py", "scripts/use-ep", "docker/Dockerfile", "docker/select-ep",
              "docker/ep-entrypoint", "docker/with-secrets", "docker/prebuilt-wheels/README.md",
              "docker/te-source/README.md"]  # fmt: skip
    assert not [name for name in needed if name not in kept], sorted(kept)


# --- EP: an unknown value, a switch --------------------------------------------------------------


@pytest.mark.slow
def test_unknown_ep_fails_at_once_listing_the_valid_values(
    docker: Docker, base_image: str, pytestconfig: pytest.Config
) -> None:
    build = docker.build("ep-image:bogus", build_args(base_image, "deepep_v3"), "bogus")
    assert build.returncode != 0
    text = build.text()
    assert "image-deepep_v3" in text, text[-3000:]
    assert f"valid EP values: {VALUES}" in text, text[-3000:]
    assert not [s for s in build.steps() if s.stage == "base"], "base started before the check"
    assert build.seconds < 60, f"took {build.seconds:.0f}s"
    announce(pytestconfig, [f"EP=deepep_v3 failed after {build.seconds:.1f}s; BuildKit quoted:"]
             + [line for line in build.log if "valid EP values" in line])  # fmt: skip


@pytest.mark.slow
def test_one_backend_builds_only_the_stages_it_selects(
    builds: Builds, docker: Docker, pytestconfig: pytest.Config
) -> None:
    visited = builds.single.stages_visited()
    assert f"ep-{SINGLE_EP}" in visited and f"image-{SINGLE_EP}" in visited, visited
    selected = {f"ep-{SINGLE_EP}", f"image-{SINGLE_EP}", f"files-{SINGLE_EP}", "ep-check"}
    others = [s for s in visited if s.startswith(("ep-", "image-", "files-")) and s not in selected]
    assert others == [], f"stages EP={SINGLE_EP} does not select ran: {others}"
    assert "legacy-builder" not in visited
    out = docker.run(builds.single.image, "python", "-c", "import json, os; print(json.dumps("
                     "json.load(open('/opt/venvs/image.json'))))")  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    image = json.loads(out.stdout.strip().splitlines()[-1])
    assert image["backends"] == [SINGLE_EP] and image["active"] == SINGLE_EP
    announce(pytestconfig, [f"EP={SINGLE_EP} from an empty cache: {builds.single.seconds:.0f}s; "
                            f"stages: {' '.join(visited)}"])  # fmt: skip


@pytest.mark.slow
def test_switching_ep_rebuilds_no_backend_venv(builds: Builds, pytestconfig: pytest.Config) -> None:
    """BuildKit's own word: every step of base, te and venvs-common CACHED when EP changes, the
    venv of a backend built before CACHED, each other backend built once; back to the first
    EP, every step CACHED."""
    multi, again = builds.multi, builds.again
    for stage in ("base", "te", "venvs-common", f"ep-{SINGLE_EP}"):
        runs = multi.runs(stage)
        assert runs and {s.status for s in runs} == {"CACHED"}, (stage, runs)
    for name in backends.BACKEND_NAMES:
        if name != SINGLE_EP:
            assert [s.status for s in multi.runs(f"ep-{name}")] == ["DONE"], name
    assert [s.status for s in multi.runs(f"image-{MULTI_EP}")] == ["DONE"]
    ran = [
        s
        for s in again.steps()
        if s.stage != "internal" and s.status != "CACHED" and not s.instruction.startswith("FROM ")
    ]  # a base image is looked up every time
    assert ran == [], f"EP={SINGLE_EP} again ran: {ran}"
    assert again.seconds < 120, f"EP={SINGLE_EP} again took {again.seconds:.0f}s"
    announce(pytestconfig, [
        f"EP={MULTI_EP} after EP={SINGLE_EP}: {multi.seconds:.0f}s (base, te, venvs-common, "
        f"ep-{SINGLE_EP} CACHED); EP={SINGLE_EP} again: {again.seconds:.1f}s, every step CACHED",
    ])  # fmt: skip


@pytest.mark.slow
def test_all_holds_every_backend_and_ep_backend_switches(
    builds: Builds, docker: Docker, pytestconfig: pytest.Config
) -> None:
    image = builds.multi.image
    script = textwrap.dedent("""
        import json, os, sys
        from pathlib import Path
        record = json.load(open("/opt/venvs/image.json"))
        lib = "lib/python3*/site-packages/torch/lib/libtorch_cpu.so"
        inodes = {b: next(Path("/opt/venvs", b).glob(lib)).stat().st_ino
                  for b in record["backends"]}
        print(json.dumps({"prefix": os.path.realpath(sys.prefix), "ep": os.environ["EP_BACKEND"],
                          "backends": record["backends"], "inodes": inodes}))
    """)
    seen = {}
    for name in [None, *backends.BACKEND_NAMES]:
        out = docker.run(image, "python", "-c", script, env={"EP_BACKEND": name} if name else {})
        assert out.returncode == 0, out.stdout + out.stderr
        seen[name] = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen[None]["backends"] == list(backends.BACKEND_NAMES)
    assert seen[None]["ep"] == SINGLE_EP and seen[None]["prefix"] == f"/opt/venvs/{SINGLE_EP}"
    for name in backends.BACKEND_NAMES:
        assert (seen[name]["ep"], seen[name]["prefix"]) == (name, f"/opt/venvs/{name}")
    assert len(set(seen[None]["inodes"].values())) == 1, seen[None]["inodes"]  # hardlinked
    wrong = docker.run(image, "true", env={"EP_BACKEND": "deepep_v3"})
    assert wrong.returncode != 0 and "deepep_v3" in wrong.stderr, wrong.stderr
    multi, single = docker.size(image), docker.size(builds.single.image)
    assert multi <= 1.03 * single, f"EP={MULTI_EP} is {multi / single:.3f}x EP={SINGLE_EP}"
    announce(pytestconfig, [
        f"EP={MULTI_EP}: {', '.join(backends.BACKEND_NAMES)}; torch one inode; EP_BACKEND "
        f"switches; {multi} bytes against {single} ({multi / single:.4f}x)",
    ])  # fmt: skip


# --- secrets -------------------------------------------------------------------------------


def secret_traces(docker: Docker, image: str, markers: list[str]) -> list[str]:
    """Where ``image`` holds any of ``markers``: its layer files, history, config."""
    found = [f"layer file {f}" for f in files_holding(docker.layer_dirs(image), markers)]
    for where, text in (("history", docker.history(image)),
                        ("config", json.dumps(docker.inspect(image)))):  # fmt: skip
        found += [f"{where}: {m}" for m in markers if m in text]
    return found


@pytest.mark.slow
def test_no_secret_in_any_layer_history_or_config(
    builds: Builds, docker: Docker, secrets: tuple[dict[str, Path], list[str]]
) -> None:
    _files, markers = secrets
    # The secrets reached the build (with-secrets read the gitconfig in every step that needs it).
    assert "with-secrets: git reads the gitconfig secret (1 insteadOf rule(s))" in (
        builds.single.text()
    )
    for build in (builds.single, builds.multi):
        assert secret_traces(docker, build.image, markers) == [], build.image
        env = docker.inspect(build.image)["Config"]["Env"]
        assert not [e for e in env if "/run/secrets" in e], env


@pytest.mark.slow
def test_the_secret_scan_finds_a_leak(
    docker: Docker, base_image: str, tmp_path: Path, secrets: tuple[dict[str, Path], list[str]]
) -> None:
    """The scan above can fail: a build that writes the secret into a layer, and one that puts
    a marker into an ARG (history) and an ENV (config), are each caught."""
    files, markers = secrets
    leaky = f"""\
        FROM {base_image}
        RUN --mount=type=secret,id=ca-bundle cp /run/secrets/ca-bundle /etc/leaked.pem
        ARG TOKEN
        RUN echo "$TOKEN" > /dev/null
        ENV SEEN={markers[1]}
    """
    (tmp_path / "Dockerfile").write_text(textwrap.dedent(leaky))
    build = docker.build("ep-image:leaky", {"TOKEN": markers[1]}, "leaky", context=tmp_path,
                         dockerfile=tmp_path / "Dockerfile", secrets=files)  # fmt: skip
    assert build.returncode == 0, build.text()[-3000:]
    traces = secret_traces(docker, build.image, markers)
    assert any(t.startswith("layer file") and t.endswith("/etc/leaked.pem") for t in traces)
    assert f"history: {markers[1]}" in traces and f"config: {markers[1]}" in traces, traces


# --- inside the image --------------------------------------------------------------------------


#: torch's CUDA libraries, which the CI profile leaves out and torch cannot import without.
CUDA_LIBRARIES = [name for name in LEFT_OUT if name.startswith("nvidia-")]


@pytest.fixture(scope="module")
def probe_image(
    builds: Builds, docker: Docker, tmp_path_factory: pytest.TempPathFactory,
    secrets: tuple[dict[str, Path], list[str]],
) -> str:  # fmt: skip
    """The EP=all image with CUDA_LIBRARIES in its active venv, from the image's own lock."""
    work = tmp_path_factory.mktemp("probe-image")
    keep_out = [p for p in LEFT_OUT if p not in CUDA_LIBRARIES] + ["transformer-engine"]
    dockerfile = f"""\
        FROM {builds.multi.image}
        RUN --mount=type=cache,target=/root/.cache/uv,id=ep-image-uv \\
            --mount=type=secret,id=ca-bundle \\
            UV_PROJECT_ENVIRONMENT=/opt/venvs/{SINGLE_EP} /opt/ep-image/docker/with-secrets \\
            uv sync --frozen --inexact --no-install-project --project /opt/ep-image \\
            --extra {SINGLE_EP} {" ".join(f"--no-install-package {p}" for p in keep_out)}
    """
    (work / "Dockerfile").write_text(textwrap.dedent(dockerfile))
    build = docker.build("ep-image:probes", {}, "probe-image", context=work,
                         dockerfile=work / "Dockerfile",
                         secrets={"ca-bundle": secrets[0]["ca-bundle"]})  # fmt: skip
    assert build.returncode == 0, build.text()[-4000:]
    return build.image


@pytest.mark.slow
@pytest.mark.parametrize(("command", "expected"), PROBE_COMMANDS)
def test_probe_passes_inside_the_image(
    probe_image: str, docker: Docker, command: list[str], expected: str,
    pytestconfig: pytest.Config,
) -> None:  # fmt: skip
    """`docker run --rm IMAGE probes/...` through the entrypoint, from the image's WORKDIR."""
    proc = docker.run(probe_image, *command, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert expected in out, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    last = [line for line in proc.stdout.splitlines() if line.strip()][-1:]
    announce(pytestconfig, [f"docker run IMAGE {' '.join(command)}: exit 0; {last}"])


# --- PREBUILT_WHEELS, from the build context and from a named build context ---------------------


@pytest.fixture(scope="module")
def fake_source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A build context whose project's hybridep is the stand-in HybridEP (a git source whose
    build needs make_venv's set-up, tests/fixtures/fake_hybridep.py), and its bare repository."""
    root = tmp_path_factory.mktemp("fake-source")
    version = pins.locked_versions(ROOT, nvshmem.DISTRIBUTION).pop()
    fake = fake_hybridep.make(root / "mirror", version, dict(os.environ))
    context = root / "context"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, check=True).stdout.decode()  # fmt: skip
    for name in filter(None, files.split("\0")):
        if (ROOT / name).is_file() and not name.startswith(("tests/", "docs/", "evidence/")):
            (context / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, context / name)
    for name in ("pyproject.toml", "uv.lock"):
        shutil.copy(fake.project / name, context / name)
    return context, fake.bare


@pytest.mark.slow
def test_prebuilt_wheels_from_the_context_and_from_a_named_context(
    docker: Docker,
    base_image: str,
    fake_source: tuple[Path, Path],
    secrets: tuple[dict[str, Path], list[str]],
    tmp_path: Path,
    pytestconfig: pytest.Config,
) -> None:
    context, bare = fake_source
    files, _markers = secrets
    # The base with what make_venv's preflight asks of a source build, as stand-ins (the
    # buildah test's with_source_build_tools): nvcc, the driver stubs, rdma-core's headers.
    tools = tmp_path / "tools"
    fake_cuda(tools / "cuda")
    rdma_home(tools / "rdma")
    (tools / "Dockerfile").write_text(
        f"FROM {base_image}\nCOPY cuda /usr/local/cuda\nCOPY rdma/include /usr/include\n"
    )
    base = "ep-test-base:source-build-tools"
    docker("build", "--network=host", "-t", base, str(tools), DOCKER_BUILDKIT="1")
    args = {**build_args(base, "hybridep"), "VENV_SKIP_PACKAGES": "",
            "TORCH_CUDA_ARCH_LIST": "9.0"}  # fmt: skip
    # The wheel, compiled and exported by make_venv in the environment of the stage that will
    # take it (the venvs-common stage's image), from the source's bare repository.
    common = docker.build("ep-image:fake-common", args, "fake-common", context, secrets=files,
                          target="venvs-common")  # fmt: skip
    assert common.returncode == 0, common.text()[-4000:]
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (tmp_path / "gitconfig").write_text(
        f'[url "file:///mirror/DeepEP.git"]\n\tinsteadOf = {fake_hybridep.UPSTREAM}\n'
    )
    export = docker(
        "run", "--rm", "--network=host", "-e", "PYTHONPATH=/opt/ep-image",
        "-e", "TORCH_CUDA_ARCH_LIST=9.0", "-v", f"{bare}:/mirror/DeepEP.git:ro",
        "-v", f"{files['ca-bundle']}:/run/secrets/ca-bundle:ro",
        "-v", f"{tmp_path / 'gitconfig'}:/run/secrets/gitconfig:ro", "-v", f"{wheels}:/out",
        common.image, "/opt/ep-image/docker/with-secrets", "python3", "-m",
        "ep_image.build_steps.make_venv", "--backend", "hybridep", "--prefix", "/tmp/venvs",
        "--project", "/opt/ep-image", "--export-wheels", "/out", check=False,
    )  # fmt: skip
    assert export.returncode == 0, export.stdout + export.stderr
    assert sorted(p.suffix for p in wheels.iterdir()) == [".json", ".whl"], list(wheels.iterdir())
    # Inside the build context, named by the build argument; then outside it, as a named
    # context. No gitconfig secret: the git source is out of reach, only the wheel can do.
    shutil.copytree(wheels, context / "wheels")
    for label, extra, contexts in (
        ("build-arg", {"PREBUILT_WHEELS": "wheels"}, None),
        ("named-context", {}, {"prebuilt-wheels": wheels}),
    ):
        build = docker.build(f"ep-image:fake-{label}", {**args, **extra}, f"fake-{label}",
                             context, secrets={"ca-bundle": files["ca-bundle"]},
                             target="ep-hybridep", build_contexts=contexts)  # fmt: skip
        text = build.text()
        assert build.returncode == 0, text[-4000:]
        assert "using the prebuilt deep_ep-" in text, (label, text[-4000:])
        assert "Building deep-ep" not in text and "Built deep-ep" not in text, label
    announce(pytestconfig, ["PREBUILT_WHEELS: the exported stand-in HybridEP wheel taken from "
                            "--build-arg PREBUILT_WHEELS=wheels and from --build-context "
                            "prebuilt-wheels=DIR, nothing compiled"])  # fmt: skip
