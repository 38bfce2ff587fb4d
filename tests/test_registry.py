"""The backend registry (ep_image/backends/) and every place that must agree with it.

One table, many readers: scripts and probes import the registry; what cannot import it (the
Dockerfile's stages, the workflows' EP lists, pyproject.toml's extras, docker/select-ep's input)
is checked against it here, so adding a backend fails loudly until every copy follows.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ep_image import backends
from ep_image.probes import _backend_detect

ROOT = Path(__file__).resolve().parents[1]


def test_registry_matches_pyproject() -> None:
    registry = backends.load_registry(ROOT)
    assert tuple(registry) == backends.BACKEND_NAMES
    pyproject = backends.read_pyproject(ROOT)
    sets = pyproject["tool"]["uv"]["conflicts"]
    # First the backends that ship one module (deep_ep), then each variant with them: exactly
    # the registry's sets, in its order; a backend alone on its module (nccl.ep) in none.
    declared = [[c["extra"] for c in s] for s in sets if s[0]["extra"] != "moe"]
    assert declared == backends.conflict_sets()
    alone = [s.name for s in backends.SPECS if not any(s.name in c for c in declared)]
    assert all(
        sum(t.module == s.module for t in backends.SPECS) == 1
        for s in backends.SPECS
        if s.name in alone
    ), alone
    # moe holds the default backend: it conflicts with every other extra shipping its module.
    moe_conflicts = {c[1]["extra"] for c in sets if c[0]["extra"] == "moe"}
    default_module = backends.spec(backends.DEFAULT_BACKEND).module
    same_module = {
        extra
        for s in backends.SPECS
        if s.module == default_module
        for extra in (s.name, *(v.extra for v in s.variants))
    }
    assert moe_conflicts == same_module - {backends.DEFAULT_BACKEND}
    for backend in registry.values():
        assert backend.requirement.startswith(backend.distribution)
    moe = pyproject["project"]["optional-dependencies"]["moe"]
    assert f"ep-image[{backends.DEFAULT_BACKEND}]" in moe, "moe must hold the default backend"


def test_names_and_selections() -> None:
    for name in backends.BACKEND_NAMES:
        assert re.fullmatch(r"[a-z][a-z0-9_]*", name), f"{name}: '-' joins names in EP values"
    assert backends.expand_backends(["all"]) == list(backends.BACKEND_NAMES)
    assert backends.expand_backends(["hybridep,deepep_v1"]) == ["deepep_v1", "hybridep"]
    assert backends.expand_backends(["deepep_v2-deepep_v1"]) == ["deepep_v1", "deepep_v2"]
    with pytest.raises(backends.UnknownBackendError, match=backends.valid_names_text()):
        backends.expand_backends(["deepep_v3"])
    values = dict(backends.image_ep_values())
    assert values["all"] == list(backends.BACKEND_NAMES)
    # Linear in the backends: each alone, and all.
    assert list(values) == [*backends.BACKEND_NAMES, "all"]
    assert backends.ep_value(["hybridep"]) == "hybridep"
    assert backends.ep_value([",".join(reversed(backends.BACKEND_NAMES))]) == "all"
    with pytest.raises(backends.UnknownBackendError, match="EP=all"):
        backends.ep_value(["deepep_v2", "deepep_v1"])


def test_active_backend_rule() -> None:
    assert backends.resolve_active(["all"]) == backends.DEFAULT_BACKEND
    assert backends.resolve_active(["deepep_v1", "hybridep"]) == "deepep_v1"
    assert backends.resolve_active(["all"], "hybridep") == "hybridep"
    with pytest.raises(backends.UnknownBackendError, match="not among the selected"):
        backends.resolve_active(["deepep_v2"], "deepep_v1")


def test_the_probe_reads_the_registry() -> None:
    """_backend_detect keeps the detection logic; its tables are the registry's, not copies."""
    assert _backend_detect.BACKEND_NAMES is backends.BACKEND_NAMES
    assert backends.layout_markers() == _backend_detect.MARKERS
    assert dict(_backend_detect.MARKERS)["hybridep"] == "hybrid_ep_buffer.py"
    assert _backend_detect.MARKERS[0][0] == "hybridep", "the hybrid-ep layout also ships buffer.py"
    assert _backend_detect.backend_from_distribution("tokenspeed-deepep", "2.1.0") == "deepep_v2"
    assert _backend_detect.backend_from_distribution("tokenspeed_deepep", "1.2.1") == "deepep_v1"
    assert _backend_detect.backend_from_distribution("deep-ep", "1.2.1") is None
    for name in backends.BACKEND_NAMES:
        assert f"use-ep {name}" in _backend_detect.INSTALL_HINTS[name]


def test_cli_lists_the_registry() -> None:
    def cli(*args: str) -> str:
        return subprocess.run(
            [sys.executable, "-m", "ep_image.backends", *args],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip

    assert cli("--names").split() == list(backends.BACKEND_NAMES)
    assert cli("--default").strip() == backends.DEFAULT_BACKEND
    assert [line.split("\t")[0] for line in cli("--image-ep").splitlines()] == [
        v for v, _ in backends.image_ep_values()
    ]


# Where a backend name may appear: the registry itself, its tests, docs, the dated runs'
# records, the pins, the Dockerfile's generated stages and default (checked against the
# registry); comments may name one as an example. The workflows take their matrices from the
# registry.
ALLOWED = (
    "docs/",
    "evidence/",
    "tests/",
    "README.md",
    "pyproject.toml",
    "uv.lock",
    "ep_image/backends/",
)


@pytest.mark.parametrize("name", backends.BACKEND_EXTRAS)
def test_backend_names_are_spelled_only_where_the_registry_reaches(name: str) -> None:
    """`git grep -w NAME` outside docs, tests, pins and the registry finds only comments and the
    Dockerfile's generated stages and default (checked against the registry): code, workflows
    and scripts take every backend from the registry."""
    found = subprocess.run(
        ["git", "grep", "-n", "-w", name, "--", "."],
        cwd=ROOT, capture_output=True, text=True, check=False,
    ).stdout.splitlines()  # fmt: skip
    if not found and name in backends.BACKEND_NAMES:
        pytest.skip("not a git checkout")
    offenders = []
    for line in found:
        path, _, text = line.split(":", 2)
        if path.startswith(ALLOWED) or text.lstrip().startswith("#"):
            continue
        if path == "docker/Dockerfile" and _is_generated_or_stage_name(text):
            continue
        offenders.append(line)
    assert not offenders, "backend names outside the registry:\n" + "\n".join(offenders)


def _is_generated_or_stage_name(text: str) -> bool:
    from ep_image.repo import dockerfile

    defaults = (
        f"ARG EP={backends.DEFAULT_BACKEND}",
        f"FROM image-${{EP:-{backends.DEFAULT_BACKEND}}}",
    )
    return (
        text in dockerfile.render().splitlines()
        or bool(re.match(r"FROM \S+ AS ", text))
        or text.startswith(defaults)
    )


def test_a_variant_installs_its_backend_from_its_own_source() -> None:
    """deepep_v2_pinned: upstream DeepEP v2 at af9a0403, not SGLang's wheel; hybridep keeps
    its own commit of the same git package (uv's per-extra sources)."""
    wheel = backends.get_backend("deepep_v2", ROOT)
    assert (wheel.extra, wheel.distribution, wheel.git) == ("deepep_v2", "sgl-deep-ep", None)
    pinned = backends.get_backend("deepep_v2", ROOT, "deepep_v2_pinned")
    assert (pinned.name, pinned.extra, pinned.distribution) == (
        "deepep_v2",
        "deepep_v2_pinned",
        "deep-ep",
    )
    assert pinned.git_rev == "af9a0403188392824fc3057452822235873e0612"
    assert backends.get_backend("hybridep", ROOT).git_rev.startswith("e0a5b1d9")
    with pytest.raises(backends.UnknownBackendError, match="its variants: none"):
        backends.get_backend("deepep_v1", ROOT, "deepep_v2_pinned")


def test_make_venv_refuses_a_variant_of_another_backend(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ep_image.build_steps.make_venv", "--backend", "deepep_v1",
         "--variant", "deepep_v2_pinned", "--prefix", str(tmp_path)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "not a variant of deepep_v1" in proc.stderr
    assert not any(tmp_path.iterdir())


def test_each_backend_has_the_adapter_of_its_api() -> None:
    """check_ep's adapters are keyed by the API (module and class) they drive; the registry
    says which backend ships which, so a backend's name is written in its module only."""
    from ep_image.probes._adapters import plugins

    for spec in backends.SPECS:
        adapter = plugins.BUILTIN[spec.name]
        assert issubclass(adapter, plugins.ADAPTERS[(spec.module, spec.api)]), spec.name
        assert adapter.name == spec.name and adapter.api == spec.api
        assert adapter.module == spec.module
    assert set(plugins.BUILTIN) == {*backends.BACKEND_NAMES, "torch"}
    # The shared adapter classes were not renamed by binding them.
    assert all(cls.name == "" for cls in plugins.ADAPTERS.values())


def test_every_internode_check_kind_has_its_check() -> None:
    from ep_image.probes.check_fabric import internode

    assert set(internode.CHECKS) == set(backends.INTERNODE_CHECKS)
    assert {s.internode_check for s in backends.SPECS} <= set(backends.INTERNODE_CHECKS)


def test_a_backend_is_its_module(tmp_path: Path) -> None:
    """Another backend is one module under ep_image/backends/: the registry lists it, in
    module-name order, with no other file touched; a module that breaks the rules is refused."""
    package = tmp_path / "ep_image"
    shutil.copytree(ROOT / "ep_image", package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "backends" / "mori_ep.py").write_text(
        "from ep_image.backends._spec import BackendSpec\n"
        "SPEC = BackendSpec(name='mori_ep', title='MORI-EP', distribution='mori-ep',\n"
        "                   layout_marker='mori.py', api='Buffer')\n"
    )
    code = "from ep_image import backends as b; print(' '.join(b.BACKEND_NAMES), b.DEFAULT_BACKEND)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True)  # fmt: skip
    listed = sorted([*backends.BACKEND_NAMES, "mori_ep"])
    assert run.stdout.split() == [*listed, backends.DEFAULT_BACKEND], run.stderr
    (package / "backends" / "mori_ep.py").write_text(
        "from ep_image.backends._spec import BackendSpec\n"
        "SPEC = BackendSpec(name='mori-ep', title='MORI-EP', distribution='mori-ep',\n"
        "                   layout_marker='mori.py', api='Buffer', default=True)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode != 0 and "SPEC.name must be the module's name" in run.stderr
    assert "ep_image/backends/mori_ep.py: SPEC.name" in run.stderr


def test_a_backend_may_be_a_package(tmp_path: Path) -> None:
    """A backend with code of its own (HybridEP's JIT cache) is a package whose __init__.py holds
    its SPEC: discovery finds it like a module, and a broken one is named by that file."""
    assert (ROOT / "ep_image" / "backends" / "hybridep" / "__init__.py").is_file()
    assert "hybridep" in backends.BACKEND_NAMES
    package = tmp_path / "ep_image"
    shutil.copytree(ROOT / "ep_image", package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "backends" / "mori_ep").mkdir()
    (package / "backends" / "mori_ep" / "__init__.py").write_text(
        "from ep_image.backends._spec import BackendSpec\n"
        "SPEC = BackendSpec(name='mori_ep', title='MORI-EP', distribution='mori-ep',\n"
        "                   layout_marker='mori.py', api='Buffer')\n"
    )
    code = "from ep_image import backends as b; print(' '.join(b.BACKEND_NAMES))"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True)  # fmt: skip
    assert run.stdout.split() == sorted([*backends.BACKEND_NAMES, "mori_ep"]), run.stderr
    (package / "backends" / "mori_ep" / "__init__.py").write_text(
        "from ep_image.backends._spec import BackendSpec\n"
        "SPEC = BackendSpec(name='mori', title='MORI-EP', distribution='mori-ep',\n"
        "                   layout_marker='mori.py', api='Buffer')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode != 0
    assert "ep_image/backends/mori_ep/__init__.py: SPEC.name must be" in run.stderr
