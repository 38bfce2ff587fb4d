"""The uv project's promises, checked with the real uv against the committed lock.

- the lock is current and covers Python 3.11 (build hosts) and 3.12 (CUDA base images);
- exactly the three backends that ship `deep_ep` conflict, and `moe` (which holds deepep_v2)
  excludes the other two; a backend alone on its module (NCCL EP's `nccl.ep`) conflicts with none
  and resolves beside each of them;
- each extra resolves to its own backend and never another's;
- asking for two backends at once fails with uv's conflict error, before anything is installed.
"""

from __future__ import annotations

import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from ep_image import backends

ROOT = Path(__file__).resolve().parents[1]
#: The backends that ship `deep_ep`, which uv must keep apart.
BACKENDS = ("deepep_v1", "deepep_v2", "hybridep")
#: The distribution that provides each backend's module (README's backend table).
BACKEND_DIST = {s.name: s.distribution for s in backends.SPECS}
#: Backends whose module no other backend ships: they conflict with none.
ALONE = [s.name for s in backends.SPECS if sum(t.module == s.module for t in backends.SPECS) == 1]
#: Backends installed from a registry wheel (the others are built from git).
REGISTRY_BACKENDS = [s.name for s in backends.SPECS if not s.builds_from_source]


def uv(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["uv", *args], cwd=ROOT, capture_output=True, text=True, check=check, timeout=600
    )


def exported_packages(*extras: str, python: str | None = None) -> set[str]:
    """Package names `uv export` would install for these extras, read from the lock alone."""
    args = ["export", "--frozen", "--no-hashes", "--no-header", "--no-annotate"]
    for extra in extras:
        args += ["--extra", extra]
    if python:
        args += ["--python", python]
    out = uv(*args).stdout
    names = set()
    for line in out.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "-")):
            continue
        names.add(re.split(r"[=@ ;\[]", line, maxsplit=1)[0].strip().lower())
    return names


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.fixture(scope="module")
def lock() -> dict:
    return tomllib.loads((ROOT / "uv.lock").read_text())


def test_lock_is_current() -> None:
    result = uv("lock", "--check", check=False)
    assert result.returncode == 0, f"uv.lock is stale; run `uv lock`:\n{result.stderr}"


def test_conflict_set_is_exactly_the_three_backends(pyproject: dict, lock: dict) -> None:
    declared = pyproject["tool"]["uv"]["conflicts"]
    assert {item["extra"] for item in declared[0]} == set(BACKENDS)
    # deepep_v2's variant (upstream DeepEP v2 at af9a0403) ships deep_ep too: it excludes all.
    assert {item["extra"] for item in declared[1]} == {*BACKENDS, "deepep_v2_pinned"}
    # moe holds deepep_v2, so it must exclude exactly the others.
    moe_sets = [{i["extra"] for i in s} for s in declared[2:]]
    assert sorted(map(sorted, moe_sets)) == [
        ["deepep_v1", "moe"],
        ["deepep_v2_pinned", "moe"],
        ["hybridep", "moe"],
    ]
    locked = [{i["extra"] for i in s} for s in lock["conflicts"]]
    assert locked[0] == {"deepep-v1", "deepep-v2", "hybridep"}
    assert locked[1] == {"deepep-v1", "deepep-v2", "deepep-v2-pinned", "hybridep"}


def test_the_deep_ep_backends_are_the_registrys() -> None:
    assert [s.name for s in backends.SPECS if s.module == backends.MODULE] == list(BACKENDS)
    assert "ncclep" in ALONE


@pytest.mark.parametrize("backend", backends.BACKEND_NAMES)
def test_each_extra_holds_its_backend_and_no_other(backend: str) -> None:
    packages = exported_packages(backend)
    assert BACKEND_DIST[backend] in packages
    others = {BACKEND_DIST[b] for b in backends.BACKEND_NAMES if b != backend}
    others -= {BACKEND_DIST[backend]}
    assert not packages & others, f"{backend} also pulls {packages & others}"
    assert "torch" in packages


def test_moe_is_deepep_v2_plus_training_stack() -> None:
    packages = exported_packages("moe")
    assert {"sgl-deep-ep", "torch", "transformer-engine", "nvidia-cudnn-cu13"} <= packages
    assert {"nvidia-nvshmem-cu13", "nvidia-nccl-cu13", "nvidia-cudnn-frontend"} <= packages
    assert not packages & {"tokenspeed-deepep", "deep-ep"}


@pytest.mark.parametrize("other", [*BACKENDS, "moe"])
@pytest.mark.parametrize("alone", ALONE)
def test_a_backend_alone_on_its_module_combines_with_every_other(alone: str, other: str) -> None:
    """NCCL EP ships `nccl.ep`, no `deep_ep`: one environment may hold it beside any DeepEP
    backend (a framework switching dispatcher at run time), from the one lock, with one NCCL."""
    packages = exported_packages(alone, other)
    assert {BACKEND_DIST[alone], BACKEND_DIST[other if other != "moe" else "deepep_v2"]} <= packages
    nccl = [line for line in uv("export", "--frozen", "--no-hashes", "--extra", alone,
                                "--extra", other).stdout.splitlines()
            if line.startswith("nvidia-nccl-cu13==")]  # fmt: skip
    assert len(nccl) == 1, nccl


@pytest.mark.parametrize("backend", backends.BACKEND_NAMES)
def test_te_extra_combines_with_every_backend(backend: str) -> None:
    """TE is not a backend: `--extra <backend> --extra te` resolves without a conflict."""
    packages = exported_packages(backend, "te")
    assert {
        BACKEND_DIST[backend],
        "transformer-engine",
        "nvidia-cudnn-cu13",
        "pydantic",
    } <= packages


def test_source_built_packages_are_pinned_to_full_commits(lock: dict) -> None:
    sources = {p["name"]: p["source"] for p in lock["package"] if "git" in p["source"]}
    assert set(sources) == {"deep-ep", "transformer-engine"}
    for name, source in sources.items():
        commit = source["git"].rsplit("#", 1)[-1]
        assert re.fullmatch(r"[0-9a-f]{40}", commit), f"{name} is not pinned to a commit: {source}"


@pytest.mark.parametrize("python", ["3.11", "3.12"])
@pytest.mark.parametrize("backend", REGISTRY_BACKENDS)
def test_lock_has_wheels_for_both_pythons(lock: dict, backend: str, python: str) -> None:
    """A registry backend must have a wheel for the build host's and the image's Python."""
    tag = "cp" + python.replace(".", "")
    dist = BACKEND_DIST[backend]
    package = next(p for p in lock["package"] if p["name"] == dist)
    wheels = [w["url"].rsplit("/", 1)[-1] for w in package.get("wheels", [])]
    assert any(f"-{tag}-" in w and "x86_64" in w for w in wheels), (
        f"no {tag} wheel of {dist}: {wheels}"
    )
    torch = next(p for p in lock["package"] if p["name"] == "torch")
    assert any(f"-{tag}-" in w["url"] and "x86_64" in w["url"] for w in torch["wheels"])


def test_python_312_resolution_matches_311() -> None:
    """The same pins for the image's Python as for the build host's."""
    assert exported_packages("moe", python="3.12") == exported_packages("moe", python="3.11")


@pytest.mark.parametrize(
    ("extras", "named"),
    [
        (("deepep_v1", "hybridep"), ("deepep-v1", "hybridep")),
        (("deepep_v1", "deepep_v2"), ("deepep-v1", "deepep-v2")),
        (("moe", "hybridep"), ("hybridep", "moe")),
        (("moe", "deepep_v1"), ("deepep-v1", "moe")),
    ],
)
def test_two_backends_fail_with_the_conflict_error(
    extras: tuple[str, ...], named: tuple[str, ...], tmp_path: Path
) -> None:
    args = ["sync", "--frozen", "--dry-run"]
    for extra in extras:
        args += ["--extra", extra]
    result = subprocess.run(
        ["uv", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "UV_PROJECT_ENVIRONMENT": str(tmp_path / "venv")},
        timeout=120,
    )
    assert result.returncode != 0
    # uv wraps its message to the terminal's width (COLUMNS): compare it as one line.
    message = " ".join(result.stderr.split())
    assert "incompatible with the declared conflicts" in message
    for name in named:
        assert f"`{name}`" in message
    assert not (tmp_path / "venv").exists(), "a conflicting sync must not create anything"


def test_each_extra_gets_its_own_commit_of_deep_ep() -> None:
    """One git package, three commits: uv resolves each extra to its own (real uv, the lock)."""

    def export(*extras: str) -> subprocess.CompletedProcess[str]:
        args = [a for e in extras for a in ("--extra", e)]
        return subprocess.run(
            ["uv", "export", "--frozen", "--no-hashes", "--project", str(ROOT), *args],
            capture_output=True, text=True, check=False, timeout=120,
        )  # fmt: skip

    pinned = export("deepep_v2_pinned")
    assert pinned.returncode == 0, pinned.stderr
    assert "DeepEP@af9a0403188392824fc3057452822235873e0612" in pinned.stdout
    assert "nvidia-nccl-cu13==2.30.7" in pinned.stdout and "sgl-deep-ep" not in pinned.stdout
    commits = {
        "deepep_v1": "567632dd59810d77b3cc05553df953cc0f779799",
        "hybridep": "e0a5b1d9848ab3e7b4a67842bf06f067bfac67f8",
        "deepep_v2_pinned": "af9a0403188392824fc3057452822235873e0612",
    }
    for extra, commit in commits.items():
        out = export(extra).stdout
        assert f"DeepEP@{commit}" in out, (extra, out)
        assert [c for c in commits.values() if f"DeepEP@{c}" in out] == [commit], extra
    for pair in (("deepep_v2", "deepep_v2_pinned"), ("moe", "deepep_v2_pinned")):
        refused = export(*pair)
        assert refused.returncode != 0 and "incompatible" in refused.stderr, pair
