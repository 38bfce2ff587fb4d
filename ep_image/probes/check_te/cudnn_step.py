"""check_te's cudnn step: the cuDNN TE was built against (te-build.json) against the one loaded.

Why its own module: importing TE proves nothing about the cuDNN it meets at run time, and this
verdict needs no GPU, so it runs (and is unit-tested on real libraries) where TE cannot load.
The survey of every mapped cuDNN library is ``_cudnn_libs``'s; this module judges it.
"""

from __future__ import annotations

import os
from typing import Any

from ep_image.probes import _cudnn_libs, _installed, _te, _versions
from ep_image.probes._report import Status, Step, StepFailed, one_line, timed_step

#: A verdict on the loaded cuDNN: (status, detail, hint, data for the report).
Verdict = tuple[Status, str, str, dict[str, Any]]


def compare_cudnn(
    build_info: dict[str, Any] | None, build_info_path: str | None, loaded: dict[str, Any]
) -> Verdict:
    """Judge the loaded cuDNN against te-build.json: (status, detail, hint, data).

    Mismatch of major.minor.patch fails and names both versions and the library that won.
    Two different libcudnn files mapped at once also fail: which one serves a call is luck.
    An absent build record is reported, not failed (TE may come from elsewhere).
    """
    data: dict[str, Any] = {
        "build_info_path": build_info_path,
        "built": None,
        "loaded": loaded.get("version"),
        "loaded_path": loaded.get("path"),
        "all_mapped": loaded.get("all_mapped", []),
    }
    if not loaded.get("path"):
        return (
            Status.ERROR,
            "no libcudnn is loaded or loadable in this process",
            "install nvidia-cudnn-cu13 in the venv (the lock pins it) and put its lib "
            "directory on the loader path",
            data,
        )
    if loaded.get("version") is None:
        return Status.ERROR, f"{loaded['path']}: {loaded.get('error')}", "", data
    distinct = sorted({os.path.realpath(p) for p in data["all_mapped"]})
    if len(distinct) > 1:
        versions = loaded.get("versions", {})
        listed = ", ".join(
            f"{p} ({versions.get(p) or versions.get(_mapped_name(p, data['all_mapped'])) or '?'})"
            for p in distinct
        )
        return (
            Status.FAIL,
            f"{len(distinct)} different libcudnn.so are mapped: {listed}",
            "load one cuDNN: put the venv's nvidia/cudnn/lib first on LD_LIBRARY_PATH (cuDNN "
            "also dlopens its sub-libraries, libcudnn_engines_*, by name from that path) and "
            "drop the base image's copy from the loader path",
            data,
        )
    if build_info is None:
        return (
            Status.INFO,
            f"loaded cuDNN {loaded['version']} from {loaded['path']}; "
            + (f"no build record at {build_info_path}" if build_info_path else "no te-build.json")
            + ", so the built-against version is unknown",
            "pass --te-build-info or set EP_TE_BUILD_INFO (python3 scripts/build_te.py "
            "writes te-build.json beside the TE wheel)",
            data,
        )
    if build_info.get("skipped"):
        return (
            Status.INFO,
            f"loaded cuDNN {loaded['version']} from {loaded['path']}; te-build.json says TE "
            f"was not built ({build_info.get('reason')})",
            "",
            data,
        )
    built = build_info.get("cudnn_version")
    data["built"] = built
    data["built_lib"] = build_info.get("cudnn_lib")
    built_v = _versions.parse_version_triplet(built)
    loaded_v = _versions.parse_version_triplet(loaded["version"])
    if built_v is None:
        return Status.INFO, f"{build_info_path} has no cudnn_version", "", data
    if built_v != loaded_v:
        return (
            Status.FAIL,
            f"TE was built against cuDNN {built} but cuDNN {loaded['version']} is loaded, "
            f"from {loaded['path']}",
            f"put {build_info.get('cudnn_lib') or 'the venv cuDNN lib directory'} first on "
            "LD_LIBRARY_PATH (or remove the other copy), or rebuild TE against the loaded "
            "cuDNN with python3 scripts/build_te.py",
            data,
        )
    where = loaded["path"]
    return Status.PASS, f"built against and loaded cuDNN {loaded['version']} ({where})", "", data


def _mapped_name(real: str, mapped: list[str]) -> str:
    """The path as mapped (maybe a symlink) whose real path is ``real``."""
    return next((p for p in mapped if os.path.realpath(p) == real), real)


def torch_loads_cudnn() -> str | None:
    """Make torch load its cuDNN, as training would; torch's own refusal of it (it compares the
    cuDNN it was compiled against with the one it finds) as text, None when it takes it."""
    import torch

    try:
        torch.backends.cudnn.version()
    except RuntimeError as exc:
        return one_line(str(exc))
    return None


def with_torch_refusal(verdict: Verdict, refusal: str | None) -> Verdict:
    """``verdict`` (compare_cudnn's) when torch took the loaded cuDNN; when torch refused it,
    a failure that still names the cuDNN TE was built against and the one loaded, and the fix
    for both (torch and TE need the cuDNN the lock installs)."""
    status, detail, _hint, data = verdict
    if refusal is None:
        return verdict
    data["torch_refuses"] = refusal
    built = data.get("built") or "unknown (no build record)"
    loaded = f"{data.get('loaded')} from {data.get('loaded_path')}"
    return (
        Status.FAIL,
        f"torch refuses the loaded cuDNN ({refusal}); TE was built against cuDNN {built}, "
        f"cuDNN {loaded} is loaded" + (f"; {detail}" if status is not Status.PASS else ""),
        "load the cuDNN the lock installs, which torch and TE were built against (the image's "
        "/opt/venvs/active-cudnn: CUDNN_PATH and LD_LIBRARY_PATH as the image sets them; in a "
        "venv its nvidia/cudnn/lib first on LD_LIBRARY_PATH), or rebuild TE and use a torch "
        "built against the loaded cuDNN (python3 scripts/build_te.py)",
        data,
    )


def with_library_mix(verdict: Verdict, libs: dict[str, Any]) -> Verdict:
    """``verdict`` with the survey of every mapped cuDNN library in its data; a failure naming
    each directory, release and the search-path cause when the process mixes cuDNN releases or
    LD_LIBRARY_PATH would mix them. That cause comes first: the version torch or
    ``cudnnGetVersion`` reports in a mixed process is whichever ``libcudnn_graph`` won."""
    status, _detail, _hint, data = verdict
    data["libraries"] = libs
    mixed = _cudnn_libs.judge(libs)
    if mixed is None:
        return verdict
    mix_detail, mix_hint = mixed
    if status is not Status.PASS and data.get("loaded"):
        mix_detail += f"; libcudnn.so reports {data['loaded']}" + (
            " (torch refuses it)" if data.get("torch_refuses") else ""
        )
        if data.get("built"):
            mix_detail += f", TE was built against {data['built']}"
    return Status.FAIL, mix_detail, mix_hint, data


def step_cudnn(build_info_path: str | None) -> Step:
    """The cudnn step: compare_cudnn's verdict, then torch's refusal, then a mix of releases,
    each overriding the one before, as the later cause explains the earlier symptom."""
    with timed_step("cudnn") as step:
        refusal = torch_loads_cudnn()
        info = _te.read_json_file(build_info_path) if build_info_path else None
        verdict = compare_cudnn(info, build_info_path, _cudnn_libs.loaded_cudnn())
        verdict = with_torch_refusal(verdict, refusal)
        status, detail, hint, data = with_library_mix(verdict, _cudnn_libs.survey())
        dist = _installed.dist_version("nvidia-cudnn-cu13", "nvidia-cudnn-cu12")
        data["cudnn_dist"] = f"{dist[0]} {dist[1]}" if dist else None
        step.data = data
        if status not in (Status.PASS, Status.INFO):
            raise StepFailed(status, detail, hint, data)
        step.status, step.detail, step.hint = status, detail, hint
    return step
