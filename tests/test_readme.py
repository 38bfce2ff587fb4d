"""README's commands, as a new user types them: in a fresh shell, on a fresh copy of the tree.

Why: README is the first thing a newcomer runs. Every command line in its ``sh`` blocks must be
accounted for here: run as typed in a shell that starts with the system's PATH (no uv on it,
Debian's own python3), or, where it needs what CI has not (a GPU, Docker, GitHub), checked
against the code that runs it elsewhere in the suite. A command README adds without a check
here fails ``test_every_command_is_accounted_for``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ep_image import backends, project

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: The PATH a login shell on a fresh Debian or Ubuntu machine starts with.
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: What a fresh shell still has on this machine: where uv's cache and the CA bundle are.
KEPT = (
    "HOME", "SSL_CERT_FILE", "PIP_CERT", "REQUESTS_CA_BUNDLE", "UV_CACHE_DIR", "XDG_CACHE_HOME",
    "http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY",
)  # fmt: skip


def blocks() -> list[list[str]]:
    """README's ``sh`` blocks, each a list of its lines (comment-only lines kept)."""
    text = README.read_text()
    return [b.splitlines() for b in re.findall(r"```sh\n(.*?)```", text, flags=re.S)]


def commands() -> list[str]:
    return [line for block in blocks() for line in block if line and not line.startswith("#")]


def block_with(first_word: str) -> list[str]:
    """The first block whose first command line starts with ``first_word``."""
    for block in blocks():
        lines = [line for line in block if line and not line.startswith("#")]
        if lines and lines[0].startswith(first_word):
            return block
    raise AssertionError(f"README has no block starting with {first_word!r}")


#: How each kind of README line is checked (the test functions below).
KINDS = {
    "docker build": r"docker build -f docker/Dockerfile --build-arg EP=\S+ -t \S+ \.(\s+#.*)?",
    "docker run": r"docker run --gpus all (-e EP_BACKEND=\S+ )?\S+ probes/check_ep\.py.*",
    "uv": r"uv (sync|run) .*",
    "eval bootstrap": r'eval "\$\(python3 scripts/bootstrap\.py --shell\)".*',
    "main job": r"python3 scripts/bootstrap\.py && python3 scripts/make_venv\.py .*",
    "tests": r"python3 scripts/bootstrap\.py --tests -- uv run --frozen --group dev pytest",
    "venv probe": r"venvs/\w+/bin/(python|torchrun) .*probes/check_ep\.py .*",
    "mirror": r"git config --global url\.\S+\.insteadOf https://github\.com/deepseek-ai/DeepEP",
    "source build": r"TORCH_CUDA_ARCH_LIST=\S+ uv sync --extra \w+",
}


def kind_of(line: str) -> str | None:
    return next((k for k, pattern in KINDS.items() if re.fullmatch(pattern, line)), None)


def test_every_command_is_accounted_for() -> None:
    unknown = [line for line in commands() if kind_of(line) is None]
    assert not unknown, f"README commands no test checks: {unknown}"


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tree as a fresh clone of it holds it (tracked and untracked-not-ignored files)."""
    tree = tmp_path_factory.mktemp("fresh") / "ep-image"
    files = subprocess.run(
        ["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
        check=True,
    ).stdout.split(b"\0")  # fmt: skip
    for rel in filter(None, files):
        source = ROOT / rel.decode()
        if source.is_file():
            (tree / rel.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, tree / rel.decode())
    return tree


def fresh_shell(tree: Path, script: str, timeout: float = 1500) -> subprocess.CompletedProcess:
    """``script`` in bash started with the system's PATH, in ``tree``."""
    env = {k: os.environ[k] for k in KEPT if k in os.environ}
    env.update(PATH=SYSTEM_PATH, LANG="C.UTF-8")
    return subprocess.run(
        ["bash", "-c", script], cwd=tree, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


@pytest.mark.slow
def test_the_uv_block_runs_as_typed(fresh: Path) -> None:
    """uv goes on PATH through the bootstrap line; the sync installs the project, so the probe
    file and the commands run; the conflicting extras fail as the block shows."""
    block = block_with('eval "$(python3 scripts/bootstrap.py')
    conflict = next(i for i, line in enumerate(block) if line.startswith("# error:"))
    script = "set -e\n" + "\n".join(block[: conflict - 1]) + "\n"
    proc = fresh_shell(fresh, script)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "result: passed (exit 0)" in proc.stdout  # the probe, in the synced venv
    failing = block[conflict - 1]
    shown = block[conflict].removeprefix("# error: ").rstrip(". ")
    proc = fresh_shell(fresh, 'eval "$(python3 scripts/bootstrap.py --shell)"\n' + failing)
    assert proc.returncode != 0
    assert shown in proc.stdout + proc.stderr, proc.stderr


@pytest.mark.slow
def test_the_design_card_lines(fresh: Path) -> None:
    """The top block's lines after its bootstrap line: `uv sync --extra hybridep` compiles
    HybridEP from GitHub (or a mirror) for many minutes, so CI runs it as far as uv's plan (the
    pinned commit, from git); `uv run probes/check_ep.py` runs whole, here without a GPU: exit 5."""
    card = block_with("docker build")
    sync = next(line for line in card if line.startswith("uv sync"))
    # The card's own bootstrap line, as typed: without it a fresh shell has no uv.
    prefix = next(line for line in card if line.startswith("eval ")) + "\n"
    assert card.index(prefix.strip()) < card.index(sync), "the card runs uv before it has uv"
    proc = fresh_shell(fresh, prefix + sync + " --dry-run")
    assert proc.returncode == 0, proc.stderr
    url, rev = project.git_source(backends.read_pyproject(ROOT), "deep-ep", "hybridep")
    assert f"+ deep-ep @ git+{url}@{rev}" in proc.stderr + proc.stdout, proc.stderr
    run = next(line for line in card if line.startswith("uv run"))
    proc = fresh_shell(fresh, prefix + f"uv sync --extra {backends.DEFAULT_BACKEND}\n" + run)
    assert proc.returncode == 5, proc.stdout + proc.stderr
    assert "no GPU" in proc.stdout


@pytest.mark.slow
def test_the_main_job_runs_as_typed(fresh: Path) -> None:
    """On a machine without a GPU: the venv is built, the probe stops with exit 5, says so, and
    the report is where the last line says."""
    line = next(c for c in commands() if kind_of(c) == "main job")
    proc = fresh_shell(fresh, line)
    assert proc.returncode == 5, proc.stdout + proc.stderr
    report = re.search(r"--json (\S+)", line)[1]  # type: ignore[index]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("report: ") and Path(last[8:]) == fresh / report, last
    assert json.loads((fresh / report).read_text())["result"] == "skipped"
    assert "no GPU" in proc.stdout


@pytest.mark.slow
def test_the_multi_rank_lines_run_as_typed(fresh: Path) -> None:
    """Both ways of starting 8 ranks reach the same verdict on this machine (no GPU: skipped),
    through the venv's own python (its exit code, 5) and torchrun (whose exit code is 1 for any
    rank's non-zero exit; the report holds the verdict), after the main job built the venv."""
    venv_lines = [c for c in commands() if kind_of(c) == "venv probe"]
    assert len(venv_lines) == 2 and any("/torchrun " in c for c in venv_lines)
    if not (fresh / "venvs" / backends.DEFAULT_BACKEND / "bin" / "python").exists():
        pytest.skip("runs after test_the_main_job_runs_as_typed, which builds the venv")
    for line in venv_lines:
        report = fresh / re.search(r"--json (\S+)", line)[1]  # type: ignore[index]
        report.unlink(missing_ok=True)
        proc = fresh_shell(fresh, line, timeout=600)
        want = 1 if "/torchrun " in line else 5
        assert proc.returncode == want, line + "\n" + proc.stdout + proc.stderr
        assert json.loads(report.read_text())["result"] == "skipped", line


def test_the_test_line_is_what_ci_runs() -> None:
    line = next(c for c in commands() if kind_of(c) == "tests")
    rows = (ROOT / ".ci" / "run").read_text().splitlines()
    assert any(row.strip().startswith(line) for row in rows)


def test_the_docker_lines_build_and_run_what_the_image_tests_build_and_run() -> None:
    """No Docker engine here: the image tests build docker/Dockerfile with buildah and run
    ``probes/check_ep.py`` through the entrypoint from the image's WORKDIR
    (tests/test_image_build.py; the GPU workflow runs it whole); here, each line names an EP
    value of the Dockerfile, a file the image holds at its WORKDIR and an image built above."""
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    values = {value for value, _ in backends.image_ep_values()}
    built = set()
    for line in (c for c in commands() if kind_of(c) == "docker build"):
        words = shlex.split(line.split("  #")[0])
        ep = next(w.split("=", 1)[1] for w in words if w.startswith("EP="))
        assert ep in values, line
        built.add(words[words.index("-t") + 1])
    assert "WORKDIR /opt/ep-image" in dockerfile
    assert "COPY probes/ /opt/ep-image/probes/" in dockerfile
    image_tests = (ROOT / "tests" / "test_image_build.py").read_text()
    assert "{entry} probes/check_ep.py --help" in image_tests  # run from the image's WORKDIR
    for line in (c for c in commands() if kind_of(c) == "docker run"):
        words = shlex.split(line)
        rest = words[2:]
        while rest[0].startswith("-"):  # --gpus all, -e NAME=VALUE: options with a value
            rest = rest[2:]
        image = rest[0]
        assert image in built, line
        assert (ROOT / words[words.index(image) + 1]).is_file(), line
        if "EP_BACKEND=" in line:
            backend = re.search(r"EP_BACKEND=(\w+)", line)[1]  # type: ignore[index]
            assert backend in backends.BACKEND_NAMES, line


@pytest.mark.slow
def test_the_mirror_lines_build_deepep_v1_as_typed(fresh: Path, tmp_path: Path) -> None:
    """The git mirror recipe and the source build it enables, with git's global config in a
    HOME of its own and README's example mirror URL replaced by a real mirror: needs a DeepEP
    mirror (EP_DEEPEP_GIT_DIR), nvcc in a CUDA 13 toolkit at /usr/local/cuda with its headers,
    and minutes of compile, so CI skips it."""
    mirror = os.environ.get("EP_DEEPEP_GIT_DIR")
    if not mirror or not Path("/usr/local/cuda/include/cusparse.h").is_file():
        pytest.skip("set EP_DEEPEP_GIT_DIR to a DeepEP mirror (and have a full CUDA 13 toolkit)")
    lines = [c for c in commands() if kind_of(c) in ("mirror", "source build")]
    example = re.search(r"url\.(\S+)\.insteadOf", lines[0])[1]  # type: ignore[index]
    # The shell of README's uv block, which put uv on PATH through its first line.
    bootstrap = block_with('eval "$(python3 scripts/bootstrap.py')[0]
    script = "\n".join(["set -e", f"export HOME={tmp_path}", bootstrap, *lines]).replace(
        example, f"file://{mirror}"
    )
    stubs = "/usr/local/cuda/lib64/stubs"
    proc = fresh_shell(fresh, f"export LIBRARY_PATH={stubs}\n" + script, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert list((fresh / ".venv").glob("lib/python3*/site-packages/deep_ep_cpp*.so"))


def test_uv_sync_installs_the_project() -> None:
    """What the uv lines rely on: the project is a package, so uv installs it with its commands."""
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["tool"]["uv"]["package"] is True
    assert {"check-ep", "check-env"} <= set(pyproject["project"]["scripts"])
    assert sys.version_info >= (3, 11)
