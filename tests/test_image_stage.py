"""ep_image/build_steps/image_stage.py assemble, on plain directories (the image tests run it in
buildah).

The prefix starts as venvs-common leaves it (one skeleton per backend); the mounts hold the
finished venvs of the ep-<backend> stages. Afterwards the prefix holds exactly the selected
venvs, each equal to its stage's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _venv_helpers import snapshot

from ep_image.build_steps import image_stage


def venv(root: Path, record: str, extra: dict[str, str] | None = None) -> Path:
    files = {"pyvenv.cfg": "home = /usr/bin\n", "lib/torch/__init__.py": "torch\n", **(extra or {})}
    for rel, text in {**files, record: json.dumps({"record": record})}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_several_backends_onto_their_skeletons(tmp_path: Path) -> None:
    prefix, mounts = tmp_path / "opt/venvs", tmp_path / "mnt"
    for name in ("deepep_v1", "deepep_v2", "hybridep"):
        venv(prefix / name, "ep-skeleton.json")
    stages = {
        name: venv(mounts / f"ep-{name}" / name, "ep-backend.json", {f"lib/{name}.py": name})
        for name in ("deepep_v1", "deepep_v2")
    }
    image_stage.assemble(["deepep_v1", "deepep_v2"], mounts, prefix)
    for name, stage in stages.items():
        assert snapshot(prefix / name) == snapshot(stage), name
    assert not (prefix / "hybridep").exists(), "the skeleton EP does not select is left"
    assert (prefix / "dedup.json").is_file()
    a, b = (prefix / n / "lib/torch/__init__.py" for n in ("deepep_v1", "deepep_v2"))
    assert a.stat().st_ino == b.stat().st_ino, "dedup.py did not run across them"


def test_one_backend_in_place_drops_the_other_skeletons(tmp_path: Path) -> None:
    prefix = tmp_path / "opt/venvs"
    venv(prefix / "deepep_v2", "ep-backend.json")
    venv(prefix / "deepep_v1", "ep-skeleton.json")
    (prefix / "active").symlink_to("deepep_v2")  # not a venv directory: left alone
    image_stage.assemble(["deepep_v2"], tmp_path / "mnt", prefix, in_place=True)
    assert sorted(p.name for p in prefix.iterdir()) == ["active", "dedup.json", "deepep_v2"]


def test_a_stage_without_a_venv_is_named(tmp_path: Path) -> None:
    prefix, mounts = tmp_path / "opt/venvs", tmp_path / "mnt"
    venv(prefix / "deepep_v1", "ep-skeleton.json")
    (mounts / "ep-deepep_v1" / "deepep_v1").mkdir(parents=True)  # an empty mount
    with pytest.raises(image_stage.StageError, match="stage ep-deepep_v1 did not build one"):
        image_stage.assemble(["deepep_v1", "deepep_v2"], mounts, prefix)
    with pytest.raises(image_stage.StageError, match="needs the stage to start FROM ep-deepep_v1"):
        image_stage.assemble(["deepep_v1"], mounts, prefix, in_place=True)
