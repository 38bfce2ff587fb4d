"""README's commands, as a new user types them: in a fresh shell, on a fresh copy of the tree.

Why: README is the first thing a newcomer runs. Every command line in its ``sh`` blocks is
resolved against what runs it (its script or program exists, takes each flag it is given, and
every extra, backend, EP value and entry point it names is declared), however the line is
spelled; the lines CI can run are run as typed in a shell that starts with the system's PATH
(no uv on it, Debian's own python3). A line whose program this file cannot resolve fails
``test_every_command_resolves_to_what_runs_it``.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ep_image import backends, pins

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: The PATH a login shell on a fresh Debian or Ubuntu machine starts with.
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: What a fresh shell still has on this machine: where uv's cache, the CA bundle and the test
#: run's temporary directory are.
KEPT = (
    "HOME", "TMPDIR", "SSL_CERT_FILE", "PIP_CERT", "REQUESTS_CA_BUNDLE", "UV_CACHE_DIR",
    "XDG_CACHE_HOME",
    "http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY",
)  # fmt: skip


def blocks() -> list[list[str]]:
    """README's ``sh`` blocks, each a list of its lines (comment-only lines kept)."""
    text = README.read_text()
    return [b.splitlines() for b in re.findall(r"```sh\n(.*?)```", text, flags=re.S)]


def commands() -> list[str]:
    return [line for block in blocks() for line in block if line and not line.startswith("#")]


def lines_running(*needles: str) -> list[str]:
    """README's command lines that run every one of ``needles`` (a script, a program)."""
    return [c for c in commands() if all(n in c.split("#")[0] for n in needles)]


def block_with(first_word: str) -> list[str]:
    """The first block whose first command line starts with ``first_word``."""
    for block in blocks():
        lines = [line for line in block if line and not line.startswith("#")]
        if lines and lines[0].startswith(first_word):
            return block
    raise AssertionError(f"README has no block starting with {first_word!r}")


def simple_commands(line: str) -> list[list[str]]:
    """``line`` as the shell splits it into simple commands (``&&``, ``||``, ``;``, ``|``), each
    a list of words, its leading ``NAME=value`` assignments and its trailing comment dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    out: list[list[str]] = [[]]
    for token in lexer:
        if set(token) <= set(";&|"):
            out.append([])
        else:
            out[-1].append(token)
    simple = []
    for words in filter(None, out):
        while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", words[0]):
            words = words[1:]
        if words:
            simple.append(words)
    return simple


def flags(words: list[str]) -> list[str]:
    """The long and short options among ``words``, without their ``=value``."""
    return [w.split("=", 1)[0] for w in words if re.fullmatch(r"--?[A-Za-z][\w-]*(=.*)?", w)]


def values_of(option: str, words: list[str]) -> list[str]:
    """The value after each ``option`` among ``words`` (``--extra a --extra b``: a, b)."""
    return [value for name, value in itertools.pairwise(words) if name == option]


def help_text(*cmd: str) -> str:
    proc = subprocess.run(
        [*cmd, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, f"{' '.join(cmd)} --help: exit {proc.returncode}\n{proc.stderr}"
    return proc.stdout


def script_and_args(words: list[str]) -> tuple[str, list[str]]:
    """``(script, its arguments)`` after an interpreter or launcher's own options."""
    for i, word in enumerate(words):
        if word.endswith(".py") and not word.startswith("-"):
            return word, words[i + 1 :]
    raise AssertionError(f"no script in {words}")


#: ``docker run`` options that take the next word as their value.
DOCKER_RUN_VALUED = {
    "-e", "--env", "--gpus", "-v", "--volume", "--ipc", "--network", "--shm-size", "--device",
    "--cap-add", "--ulimit", "--name", "-w", "--workdir", "--entrypoint", "-u", "--user",
    "--mount",
}  # fmt: skip


class Resolver:
    """What README's command lines name, checked against what runs them: each file exists,
    each flag is one its program's ``--help`` lists, each extra, backend, EP value and entry
    point is one the project declares. How a line is spelled is free; what it names is not."""

    def __init__(self) -> None:
        pyproject = backends.read_pyproject(ROOT)
        self.extras = set(pyproject["project"]["optional-dependencies"])
        self.entry_points = set(pyproject["project"]["scripts"])
        self.images: set[str] = set()
        self._help: dict[tuple[str, ...], str] = {}

    def help(self, *cmd: str) -> str:
        if cmd not in self._help:
            self._help[cmd] = help_text(*cmd)
        return self._help[cmd]

    def check_flags(self, words: list[str], *cmd: str) -> list[str]:
        text = self.help(*cmd)
        return [f"{' '.join(cmd)} has no {flag}" for flag in flags(words) if flag not in text]

    def python_script(self, words: list[str]) -> list[str]:
        script, args = script_and_args(words)
        if not (ROOT / script).is_file():
            return [f"no file {script}"]
        if "--" in args:  # bootstrap.py ... -- COMMAND: its own flags, then the command it runs
            own, command = args[: args.index("--")], args[args.index("--") + 1 :]
            return self.check_flags(own, sys.executable, script) + self.resolve(command)
        return self.check_flags(args, sys.executable, script)

    def venv_tool(self, words: list[str]) -> list[str]:
        """``venvs/<backend>/bin/python|torchrun ...``: a venv make_venv makes, by backend."""
        backend, tool = words[0].split("/")[1], words[0].rsplit("/", 1)[1]
        problems = [] if backend in backends.BACKEND_NAMES else [f"no backend {backend}"]
        if tool == "torchrun":
            script, args = script_and_args(words)
            launcher = words[1 : words.index(script)]
            problems += self.check_flags(launcher, sys.executable, "-m", "torch.distributed.run")
            return [*problems, *self.python_script([sys.executable, script, *args])]
        return [*problems, *self.python_script(words)]

    def uv(self, words: list[str]) -> list[str]:
        sub = words[1]
        rest = words[2:]
        problems = []
        extras = values_of("--extra", rest)
        problems += [f"no extra {e}" for e in extras if e not in self.extras]
        if sub == "run":
            given = {*extras, *values_of("--group", rest)}
            target = next((w for w in rest if not w.startswith("-") and w not in given), None)
            own = rest[: rest.index(target)] if target else rest
            problems += self.check_flags(own, "uv", "run")
            if target is None:
                return [*problems, "uv run without a command"]
            if target.endswith(".py"):
                return [
                    *problems,
                    *self.python_script([sys.executable, *rest[rest.index(target) :]]),
                ]
            runnable = (
                target in self.entry_points
                or shutil.which(target)
                or (Path(sys.executable).parent / target).exists()  # a dev-group tool
            )
            return problems + ([] if runnable else [f"uv run {target}: no such command"])
        return problems + self.check_flags(rest, "uv", sub)

    def docker(self, words: list[str]) -> list[str]:
        """No Docker engine is needed: `build` names the Dockerfile and an EP value it takes;
        `run` an image built above and a file the image holds at its WORKDIR (the repository's
        own, copied there) with flags its --help lists."""
        sub, rest = words[1], words[2:]
        values = {value for value, _ in backends.image_ep_values()}
        if sub == "build":
            dockerfile, tag = values_of("-f", rest)[0], values_of("-t", rest)[0]
            problems = [] if (ROOT / dockerfile).is_file() else [f"no file {dockerfile}"]
            for arg in values_of("--build-arg", rest):
                name, _, value = arg.partition("=")
                if name == "EP" and value not in values:
                    problems.append(f"EP={value} is none of {sorted(values)}")
            self.images.add(tag)
            return problems
        if sub == "run":
            i = 0
            while rest[i].startswith("-"):
                i += 2 if rest[i] in DOCKER_RUN_VALUED else 1
            image, command = rest[i], rest[i + 1 :]
            problems = [] if image in self.images else [f"image {image} is not built above"]
            for env in values_of("-e", rest[:i]):
                name, _, value = env.partition("=")
                if name == "EP_BACKEND" and value not in backends.BACKEND_NAMES:
                    problems.append(f"EP_BACKEND={value} is no backend")
            return problems + self.python_script([sys.executable, *command])
        return [f"docker {sub}: not checked here"]

    def git(self, words: list[str]) -> list[str]:
        """Run for real, in a HOME of its own, and read back."""
        home = Path(tempfile.mkdtemp(prefix="readme-git-"))
        try:
            env = {"HOME": str(home), "PATH": os.environ["PATH"]}
            proc = subprocess.run(words, env=env, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                return [f"{' '.join(words)}: {proc.stderr.strip()}"]
            key, value = words[-2], words[-1]
            read = ["git", "config", "--global", "--get", key]
            got = subprocess.run(read, env=env, capture_output=True, text=True, check=False)
            got = got.stdout.strip()
            return [] if got == value else [f"git config reads {key} back as {got!r}"]
        finally:
            shutil.rmtree(home)

    def resolve(self, words: list[str]) -> list[str]:
        program = words[0]
        if program == "eval":
            inner = re.fullmatch(r"\$\((.*)\)", words[1])
            assert inner, words
            return [p for cmd in simple_commands(inner[1]) for p in self.resolve(cmd)]
        if program == "python3":
            return self.python_script(words)
        if re.fullmatch(r"venvs/\w+/bin/(python|torchrun)", program):
            return self.venv_tool(words)
        if program == "uv":
            return self.uv(words)
        if program == "docker":
            return self.docker(words)
        if program == "git":
            return self.git(words)
        return [f"README runs {program}, which this test does not resolve: teach Resolver"]


def test_every_command_resolves_to_what_runs_it() -> None:
    """Every simple command of every README line: its files, flags, extras, backends, EP
    values and entry points exist (the slow tests below run the lines CI can run)."""
    resolver = Resolver()
    problems = [
        f"{line}\n    {problem}"
        for line in commands()
        for words in simple_commands(line)
        for problem in resolver.resolve(words)
    ]
    assert not problems, "README lines that name what does not exist:\n" + "\n".join(problems)


def test_the_resolver_finds_a_wrong_file_flag_extra_and_value() -> None:
    """The check itself: each kind of mistake a README edit can make is named."""
    resolver = Resolver()
    wrong = {
        "python3 scripts/make_venv.py --no-such-flag": "has no --no-such-flag",
        "python3 scripts/no_such.py --backend x": "no file scripts/no_such.py",
        "uv sync --extra no_such_extra": "no extra no_such_extra",
        "uv run no-such-command": "no such command",
        "docker build -f docker/Dockerfile --build-arg EP=nope -t x .": "EP=nope",
        "venvs/nope/bin/python probes/check_ep.py": "no backend nope",
        "docker run --rm --gpus all ep-image:none probes/check_ep.py": "not built above",
        "docker run --rm -e EP_BACKEND=x ep-image:all probes/check_ep.py": "EP_BACKEND=x",
        "curl https://example.com": "does not resolve",
    }
    for line, said in wrong.items():
        problems = [p for words in simple_commands(line) for p in resolver.resolve(words)]
        assert any(said in p for p in problems), (line, problems)
    fine = "python3 scripts/bootstrap.py && X=1 venvs/deepep_v2/bin/python probes/check_ep.py  # ok"
    assert [p for w in simple_commands(fine) for p in resolver.resolve(w)] == []


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
def test_the_first_block_runs_in_order(fresh: Path) -> None:
    """README's first block after its Docker lines, in its order: the bootstrap line puts uv on
    PATH before any uv line; `uv sync --extra hybridep` compiles HybridEP from GitHub (or a
    mirror) for many minutes, so CI runs it as far as uv's plan (the pinned commit, from git);
    `uv run probes/check_ep.py` runs whole, here without a GPU: exit 5."""
    first = [line for line in blocks()[0] if line and not line.startswith("#")]
    bootstrap = next(i for i, line in enumerate(first) if line.startswith("eval "))
    uv_lines = [i for i, line in enumerate(first) if line.startswith("uv ")]
    assert uv_lines and bootstrap < min(uv_lines), "the block runs uv before it has uv"
    prefix = first[bootstrap] + "\n"
    sync = first[next(i for i in uv_lines if first[i].startswith("uv sync"))]
    proc = fresh_shell(fresh, prefix + sync + " --dry-run")
    assert proc.returncode == 0, proc.stderr
    extra = sync.split("--extra", 1)[1].split()[0]
    url, rev = pins.git_source(backends.read_pyproject(ROOT), "deep-ep", extra)
    assert f"+ deep-ep @ git+{url}@{rev}" in proc.stderr + proc.stdout, proc.stderr
    run = first[next(i for i in uv_lines if first[i].startswith("uv run"))]
    proc = fresh_shell(fresh, prefix + f"uv sync --extra {backends.DEFAULT_BACKEND}\n" + run)
    assert proc.returncode == 5, proc.stdout + proc.stderr
    assert "no GPU" in proc.stdout


@pytest.mark.slow
def test_the_main_job_runs_as_typed(fresh: Path) -> None:
    """On a machine without a GPU: the venv is built, the probe stops with exit 5, says so, and
    the report is where the last line says."""
    line = lines_running("scripts/make_venv.py", "probes/check_ep.py")[0]
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
    venv_lines = [c for c in commands() if c.startswith("venvs/")]
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
    line = next(c for c in commands() if any(w[-1:] == ["pytest"] for w in simple_commands(c)))
    rows = (ROOT / ".ci" / "run").read_text().splitlines()
    assert any(row.strip().startswith(line) for row in rows)


#: The tests that failed after README's `uv sync --extra ncclep` and then its test line: each
#: found NCCL EP where the dev environment has no backend.
TESTS_A_BACKEND_BREAKS = (
    "tests/test_check_env.py::test_no_deep_ep_here_is_null",
    "tests/test_check_ep.py::test_torch_backend_bf16_under_torchrun",
    "tests/test_check_fabric.py::test_this_machine_real_sys",
)


@pytest.mark.slow
def test_the_test_line_runs_after_a_backend_was_synced(fresh: Path, tmp_path: Path) -> None:
    """README's uv section syncs a backend into the project's environment (`uv sync --extra
    ncclep`); its test line then ran the tests in that environment as left, and three failed
    (NCCL EP picked or reported where none was expected). The test line's uv invocation makes
    the environment exactly the dev group: here, in a throwaway project environment
    (UV_PROJECT_ENVIRONMENT), those three pass right after the sync and the extra is gone."""
    line = next(c for c in commands() if any(w[-1:] == ["pytest"] for w in simple_commands(c)))
    words = shlex.split(line)
    assert words[:2] == ["python3", "scripts/bootstrap.py"], line
    uv_run = words[words.index("--") + 1 :]  # bootstrap.py's own flags apt-get: not here
    env = tmp_path / "env"
    prefix = f"set -e\nexport UV_PROJECT_ENVIRONMENT={shlex.quote(str(env))}\n"

    def has_ncclep() -> bool:
        return bool(list(env.glob("lib/python3*/site-packages/nccl_extensions-*.dist-info")))

    proc = fresh_shell(
        fresh, prefix + "python3 scripts/bootstrap.py -- uv sync --frozen --extra ncclep"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert has_ncclep(), "the sync did not install NCCL EP"
    run = shlex.join(
        ["python3", "scripts/bootstrap.py", "--", *uv_run, "-n0", *TESTS_A_BACKEND_BREAKS]
    )
    proc = fresh_shell(fresh, prefix + run)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    summary = [row for row in proc.stdout.splitlines() if row.startswith("=") and " in " in row]
    assert summary and "passed" in summary[-1], proc.stdout[-3000:]
    assert "failed" not in summary[-1] and "error" not in summary[-1], summary[-1]
    assert not has_ncclep(), "the test line left the synced backend in place"


def test_the_docker_lines_run_what_the_image_holds() -> None:
    """No Docker engine here: the resolver checks each docker line's Dockerfile, EP values,
    images and probe file; what makes `docker run IMAGE probes/check_ep.py` run is the image's
    WORKDIR holding the repository's probes/ (tests/test_image_build.py runs it through the
    entrypoint; the GPU workflow runs it whole)."""
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert "WORKDIR /opt/ep-image" in dockerfile
    assert "COPY probes/ /opt/ep-image/probes/" in dockerfile
    image_tests = (ROOT / "tests" / "test_image_build.py").read_text()
    assert "{entry} probes/check_ep.py --help" in image_tests  # run from the image's WORKDIR
    assert lines_running("docker run"), "README has no docker run line"


@pytest.mark.slow
def test_the_mirror_lines_build_deepep_v1_as_typed(fresh: Path, tmp_path: Path) -> None:
    """The git mirror recipe and the source build it enables, with git's global config in a
    HOME of its own and README's example mirror URL replaced by a real mirror: needs a DeepEP
    mirror (EP_DEEPEP_GIT_DIR), nvcc in a CUDA 13 toolkit at /usr/local/cuda with its headers,
    and minutes of compile, so CI skips it."""
    mirror = os.environ.get("EP_DEEPEP_GIT_DIR")
    if not mirror or not Path("/usr/local/cuda/include/cusparse.h").is_file():
        pytest.skip("set EP_DEEPEP_GIT_DIR to a DeepEP mirror (and have a full CUDA 13 toolkit)")
    mirror = lines_running("git config", "insteadOf")[0]
    lines = [mirror, next(c for c in commands() if "uv sync" in c and "TORCH_CUDA_ARCH_LIST=" in c)]
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
