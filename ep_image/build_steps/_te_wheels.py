"""Which Transformer Engine wheel a backend venv gets, checked against build_te's record.

Why: TE is built once (build_te) and installed into every backend venv from that one wheel.
"""

from __future__ import annotations

import json
from pathlib import Path

from ep_image.build_steps._uv.run import run
from ep_image.cli import FixableError
from ep_image.files.records import sha256_file

TE_DISTRIBUTION = "transformer-engine"
#: What a TE build may install besides TE itself (its framework and core wheels).
TE_DISTRIBUTIONS = (TE_DISTRIBUTION, "transformer-engine-torch", "transformer-engine-cu13")
TE_EXTRA = "te"  # TE's runtime dependencies and cuDNN, from the lock
#: build_te's record of a TE build (or of its skipping), beside the wheel.
TE_RECORD = "te-build.json"


def recorded_te_wheels(record_path: Path, wheel_dir: Path) -> list[Path]:
    """The TE wheel ``record_path`` (a te-build.json) names, found in ``wheel_dir`` with that
    sha256; none when the record says TE was skipped.

    Why: the image's ep stages take the record by COPY (it keys buildah's cache on the wheel's
    hash) and the wheel through a bind mount of the te stage (keeping it out of their layers,
    hence out of a one-backend image). A mount that came up empty or from another TE build must
    fail the venv, not silently give it no TE or the wrong one.
    """
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError) as exc:
        raise FixableError(
            f"--te-record {record_path}: {exc}",
            f"pass --te-record the {TE_RECORD} that build_te wrote beside its wheel",
        ) from None
    beside = wheel_dir / TE_RECORD
    try:
        same = json.loads(beside.read_text()) == record
    except (OSError, ValueError):
        same = False
    if not same:
        raise FixableError(
            f"{wheel_dir} does not hold the TE build that {record_path} records ({beside} is "
            f"{'different' if beside.is_file() else 'missing'}): the te stage's output is not "
            "what this step was given",
            "in an image build the builder did not mount the te stage: build again, and if it "
            "repeats, with --no-cache; on a host, pass the directory build_te --out wrote, "
            "which holds both",
        )
    if not record.get("wheel"):
        return []  # TE_BUILD=skip: the record says so, and why
    wheel = wheel_dir / str(record["wheel"])
    if not wheel.is_file() or sha256_file(wheel) != record.get("wheel_sha256"):
        raise FixableError(
            f"{wheel} is {'not the wheel' if wheel.is_file() else 'missing, but'} "
            f"{record_path} records (sha256 {record.get('wheel_sha256')})",
            "rebuild TE with python3 -m ep_image.build_steps.build_te --out DIR and pass that DIR",
        )
    return [wheel.resolve()]


def select_te_wheels(wheels: list[Path], wheel_dir: Path | None, record: Path | None) -> list[Path]:
    """``wheels`` (--te-wheel), plus exactly the one ``record`` names in ``wheel_dir``, or else
    every transformer_engine-*.whl in ``wheel_dir``. No wheel found is said, not an error; a
    record that ``wheel_dir`` does not match is a FixableError (exit 1, nothing made yet).
    ``record`` needs ``wheel_dir``."""
    selected = [w.resolve() for w in wheels]
    if record is not None:
        assert wheel_dir is not None, "--te-record needs --te-wheel-dir"
        selected += recorded_te_wheels(record, wheel_dir.resolve())
        if not selected:
            print(f"make_venv: {record} records no TE wheel (TE skipped): no TE")
    elif wheel_dir is not None:
        found = sorted(wheel_dir.resolve().glob("transformer_engine-*.whl"))
        if not found:
            print(f"make_venv: no transformer_engine-*.whl in {wheel_dir}: no TE")
        selected += found
    return selected


def install_te(uv: str, venv: Path, wheels: list[Path]) -> None:
    """The Transformer Engine wheel(s) built once by build_te, without re-resolving.

    ``--no-config``: a built wheel needs none of the project's build settings (its
    extra-build-dependencies would otherwise apply to the transformer-engine name).
    """
    if wheels:
        python = str(venv / "bin" / "python")
        cmd = [uv, "pip", "install", "--no-config", "--python", python, "--no-deps"]
        run([*cmd, *map(str, wheels)])
