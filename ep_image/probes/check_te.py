#!/usr/bin/env python3
"""check_te: prove that Transformer Engine (TE) works here, fused attention backward included.

Importing TE proves nothing about the cuDNN it meets at run time: this probe compares the cuDNN
TE was built against with the one loaded, then checks fused attention and ``te.Linear``, forward
and backward, against plain torch in fp32. See docs/probes.md, section "check-te".
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from ep_image import cli
from ep_image.probes import _cudnn_libs, _facts, _venv_record
from ep_image.probes._report import (
    Status,
    Step,
    StepFailed,
    build_report,
    exit_code_of,
    one_line,
    render_table,
    timed_step,
    write_report,
)

PROG = "check_te"
STEP_NAMES = ("import", "cudnn", "fused_attention", "linear")
#: Only TE's fused (cuDNN) attention backend may run: the one the cuDNN mismatch breaks.
FUSED_ONLY_ENV = {"NVTE_FUSED_ATTN": "1", "NVTE_FLASH_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"}
#: Relative difference (||out - ref|| / ||ref||) accepted against fp32 torch.
ATTN_FWD_TOL = 2e-2
ATTN_BWD_TOL = 5e-2
LINEAR_TOL = 2e-2
#: The variables Transformer Engine's import searches for cuDNN, NVRTC and cuRAND, in its order
#: (transformer_engine/common/__init__.py, ``_load_cuda_library_from_system``): for each one that
#: is set, it globs ``<value>/**/lib<name>.so*`` recursively, and it skips only an *unset* one.
TE_LOOKUP_VARS = (
    *(f"{lib}_{kind}" for lib in ("CUDNN", "NVRTC", "CURAND") for kind in ("HOME", "PATH")),
    "CUDA_HOME",
    "CUDA_PATH",
)
INSTALL_HINT = (
    "install Transformer Engine built from source against this venv's cuDNN: "
    "python3 scripts/build_te.py (the `moe` extra pins it), or activate the image's venv"
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.Parser(
        prog="check_te.py",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Prove that Transformer Engine works here: the cuDNN it was built against is the "
            "one loaded, and fused attention (forward and backward) and Linear match plain "
            "torch on the GPU."
        ),
        epilog="""\
exit codes:
  0 all passed   1 a check failed (wrong numbers, cuDNN built != loaded)   2 bad usage
  3 TE imports but fails at run time   4 TE missing   5 cannot run here (no GPU; --require: 1)
""",
    )
    parser.add_argument(
        "--te-build-info",
        metavar="PATH",
        help="te-build.json written by build_te.py (default: $EP_TE_BUILD_INFO, else "
        f"{_facts.DEFAULT_TE_BUILD_INFO})",
    )
    parser.add_argument("--batch", type=int, default=2, help="attention batch (default: 2)")
    parser.add_argument("--seq", type=int, default=512, help="sequence length (default: 512)")
    parser.add_argument("--heads", type=int, default=16, help="attention heads (default: 16)")
    parser.add_argument("--head-dim", type=int, default=128, help="head size (default: 128)")
    parser.add_argument(
        "--features", type=int, default=1024, help="Linear in/out features (default: 1024)"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_json()
    parser.add_require(
        "treat 'cannot run here' (exit 5) as a failure (exit 1): for CI on GPU runners"
    )
    args = parser.parse_args(argv)
    for name in ("batch", "seq", "heads", "head_dim", "features"):
        if getattr(args, name) <= 0:
            flag = "--" + name.replace("_", "-")
            raise cli.UsageError(f"{flag} must be a positive integer, got {getattr(args, name)}")
    return args


# ------------------------------------------------------------------------------------------
# cuDNN: built vs loaded (pure functions, unit-tested with real libraries)
# ------------------------------------------------------------------------------------------


def compare_cudnn(
    build_info: dict[str, Any] | None, build_info_path: str, loaded: dict[str, Any]
) -> tuple[Status, str, str, dict[str, Any]]:
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
            f"loaded cuDNN {loaded['version']} from {loaded['path']}; no build record at "
            f"{build_info_path}, so the built-against version is unknown",
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
    built_v = _facts.parse_version_triplet(built)
    loaded_v = _facts.parse_version_triplet(loaded["version"])
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


# ------------------------------------------------------------------------------------------
# Steps
# ------------------------------------------------------------------------------------------


def unbounded_lookup_vars(environ: Mapping[str, str]) -> dict[str, str]:
    """TE's lookup variables whose value would make its recursive glob walk the whole file
    system: empty (``docker run -e CUDNN_PATH=``; TE globs ``/**/libcudnn.so*``, through /proc
    and /sys, and its import never ends) or naming ``/`` itself."""
    return {
        name: environ[name]
        for name in TE_LOOKUP_VARS
        if name in environ and (not environ[name] or os.path.realpath(environ[name]) == "/")
    }


def import_failure(text: str, gpu: bool) -> tuple[Status, str, str]:
    """How a failed TE import ends: ``(status, detail, hint)``.

    A library bound to a cuDNN sub-library of another release (``undefined symbol ...,
    version libcudnn_graph.so.9``) is an error on any node, and its fix is the search path that
    found the other release, not TE's build. Anything else cannot be judged without a GPU (TE
    needs the driver to load); with one, TE's build is the suspect.
    """
    foreign = _cudnn_libs.foreign_sublibrary(text)
    if foreign is not None:
        return Status.ERROR, f"import failed: {one_line(text)}: {foreign[0]}", foreign[1]
    if not gpu:
        return (
            Status.SKIP,
            f"transformer_engine is installed but does not load without a GPU: {text}",
            "no GPU visible: run on a GPU node",
        )
    hint = INSTALL_HINT
    if "cudnn" in text.lower():
        hint = "TE and the loaded cuDNN disagree: " + INSTALL_HINT
    return Status.ERROR, f"import failed: {text}", hint


def step_import() -> tuple[Step, Any]:
    """Import TE's torch API; MISSING when TE is not installed at all.

    TE's lookup variables that would make its import search all of / are removed from this
    process's environment first, so that an empty one means unset here, as a user who wrote
    ``-e CUDNN_PATH=`` meant; TE itself skips only an unset one, so the step names them: TE in
    any other process would still hang on them.
    """
    te = None
    with timed_step("import") as step:
        found = _facts.dist_version(*_facts.TE_DISTRIBUTIONS)
        module_dir = _facts.module_dir("transformer_engine")
        step.data = {
            "distribution": found[0] if found else None,
            "version": found[1] if found else None,
            "module_dir": str(module_dir) if module_dir else None,
        }
        if module_dir is None:
            raise StepFailed(
                Status.MISSING,
                "transformer_engine is not installed in this environment"
                + (f" (only the {found[0]} {found[1]} metadata is)" if found else ""),
                INSTALL_HINT,
                step.data,
            )
        ignored = unbounded_lookup_vars(os.environ)
        for name in ignored:
            del os.environ[name]
        step.data["lookup_env"] = {n: os.environ.get(n) for n in TE_LOOKUP_VARS}
        step.data["lookup_env_ignored"] = ignored
        note = ""
        if ignored:
            names = ", ".join(f"{n}={v!r}" for n, v in ignored.items())
            note = (
                f" ({names}: taken as unset here; unset them, since TE's own import searches "
                "all of / for such a value and never ends)"
            )
        import torch

        try:
            import transformer_engine
            import transformer_engine.pytorch as te
        except Exception as exc:
            text = f"{type(exc).__name__}: {exc}"
            status, detail, hint = import_failure(text, torch.cuda.is_available())
            raise StepFailed(status, detail + note, hint, step.data) from None
        step.data["version"] = getattr(transformer_engine, "__version__", step.data["version"])
        step.data["module_path"] = getattr(transformer_engine, "__file__", None)
        step.detail = (
            f"transformer_engine {step.data['version']} at {step.data['module_path']}; "
            f"torch {torch.__version__} (CUDA {torch.version.cuda}){note}"
        )
    return step, te


def torch_loads_cudnn() -> str | None:
    """Make torch load its cuDNN, as training would; torch's own refusal of it (it compares the
    cuDNN it was compiled against with the one it finds) as text, None when it takes it."""
    import torch

    try:
        torch.backends.cudnn.version()
    except RuntimeError as exc:
        return one_line(str(exc))
    return None


def with_torch_refusal(
    verdict: tuple[Status, str, str, dict[str, Any]], refusal: str | None
) -> tuple[Status, str, str, dict[str, Any]]:
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


def with_library_mix(
    verdict: tuple[Status, str, str, dict[str, Any]], libs: dict[str, Any]
) -> tuple[Status, str, str, dict[str, Any]]:
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


def step_cudnn(build_info_path: str) -> Step:
    with timed_step("cudnn") as step:
        refusal = torch_loads_cudnn()
        info = _facts.read_json_file(build_info_path)
        verdict = compare_cudnn(info, build_info_path, _facts.loaded_cudnn())
        verdict = with_torch_refusal(verdict, refusal)
        status, detail, hint, data = with_library_mix(verdict, _cudnn_libs.survey())
        dist = _facts.dist_version("nvidia-cudnn-cu13", "nvidia-cudnn-cu12")
        data["cudnn_dist"] = f"{dist[0]} {dist[1]}" if dist else None
        step.data = data
        if status not in (Status.PASS, Status.INFO):
            raise StepFailed(status, detail, hint, data)
        step.status, step.detail, step.hint = status, detail, hint
    return step


def _need_gpu(name: str) -> None:
    import torch

    if not torch.cuda.is_available():
        raise StepFailed(Status.SKIP, f"{name} needs a GPU", "no GPU visible: run on a GPU node")


@contextmanager
def _te_call(what: str) -> Iterator[None]:
    """Run a TE call; an exception is "unusable" (3), naming the call and, for cuDNN, the fix."""
    try:
        yield
    except StepFailed:
        raise
    except Exception as exc:
        text = one_line(f"{type(exc).__name__}: {exc}")
        hint = ""
        if "cudnn" in text.lower():
            hint = (
                "TE failed inside cuDNN: make the cudnn step pass (one libcudnn loaded, the one "
                "TE was built against; its sub-libraries come from the same directory), or "
                "rebuild TE against the loaded cuDNN with python3 scripts/build_te.py"
            )
        raise StepFailed(Status.ERROR, f"{what} raised {text}", hint) from None


def _rel(out: Any, ref: Any) -> float:
    out, ref = out.detach(), ref.detach()
    ref64 = ref.double()
    denom = float(ref64.norm())
    num = float((out.double() - ref64).norm())
    return num / denom if denom > 0 else num


def step_fused_attention(te: Any, args: argparse.Namespace) -> Step:
    """Fused (cuDNN) attention, causal, bf16: forward and backward against fp32 SDPA."""
    with timed_step("fused_attention") as step:
        _need_gpu("fused attention")
        import torch
        import torch.nn.functional as F

        torch.manual_seed(args.seed)
        b, s, h, d = args.batch, args.seq, args.heads, args.head_dim
        dev = torch.device("cuda")
        q, k, v = (
            torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16).requires_grad_()
            for _ in range(3)
        )
        attn = te.DotProductAttention(
            num_attention_heads=h,
            kv_channels=d,
            attn_mask_type="causal",
            qkv_format="bshd",
            attention_dropout=0.0,
        )
        with _te_call("fused attention forward"):
            out = attn(q, k, v)  # [b, s, h*d]
            torch.cuda.synchronize()
        grad = torch.randn_like(out)
        with _te_call("fused attention backward"):
            out.backward(grad)
            torch.cuda.synchronize()

        qf, kf, vf = (t.detach().float().transpose(1, 2).requires_grad_() for t in (q, k, v))
        ref = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True)  # [b, h, s, d]
        ref = ref.transpose(1, 2).reshape(b, s, h * d)
        ref.backward(grad.float())
        diffs = {
            "out": _rel(out.float(), ref),
            "dq": _rel(q.grad.float(), qf.grad.transpose(1, 2)),
            "dk": _rel(k.grad.float(), kf.grad.transpose(1, 2)),
            "dv": _rel(v.grad.float(), vf.grad.transpose(1, 2)),
        }
        step.data = {
            "shape_bshd": [b, s, h, d],
            "rel_diff": diffs,
            "tolerance": {"forward": ATTN_FWD_TOL, "backward": ATTN_BWD_TOL},
            "backend_env": FUSED_ONLY_ENV,
        }
        bad = [
            f"{name} {value:.3g}"
            for name, value in diffs.items()
            if not value <= (ATTN_FWD_TOL if name == "out" else ATTN_BWD_TOL)
        ]
        if bad:
            raise StepFailed(
                Status.FAIL,
                f"fused attention differs from fp32 SDPA: {', '.join(bad)} (limits "
                f"{ATTN_FWD_TOL:g} forward, {ATTN_BWD_TOL:g} backward)",
                "TE's fused attention computes wrong values with this cuDNN: rebuild TE "
                "against the loaded cuDNN (python3 scripts/build_te.py)",
                step.data,
            )
        step.detail = (
            f"bf16 causal {b}x{s}x{h}x{d}, fused backend only: rel diff out "
            f"{diffs['out']:.2g}, dq {diffs['dq']:.2g}, dk {diffs['dk']:.2g}, dv {diffs['dv']:.2g}"
        )
    return step


def step_linear(te: Any, args: argparse.Namespace) -> Step:
    """te.Linear in bf16, forward and backward, against F.linear in fp32."""
    with timed_step("linear") as step:
        _need_gpu("TE Linear")
        import torch
        import torch.nn.functional as F

        torch.manual_seed(args.seed + 1)
        n = args.features
        layer = te.Linear(n, n, bias=True, params_dtype=torch.bfloat16, device="cuda")
        x = torch.randn(args.seq, n, device="cuda", dtype=torch.bfloat16).requires_grad_()
        with _te_call("te.Linear forward"):
            y = layer(x)
            torch.cuda.synchronize()
        grad = torch.randn_like(y)
        with _te_call("te.Linear backward"):
            y.backward(grad)
            torch.cuda.synchronize()

        w = layer.weight.detach().float().requires_grad_()
        bias = layer.bias.detach().float().requires_grad_()
        xf = x.detach().float().requires_grad_()
        ref = F.linear(xf, w, bias)
        ref.backward(grad.float())
        diffs = {
            "out": _rel(y.float(), ref),
            "dx": _rel(x.grad.float(), xf.grad),
            "dw": _rel(layer.weight.grad.float(), w.grad),
            "db": _rel(layer.bias.grad.float(), bias.grad),
        }
        step.data = {"features": n, "tokens": args.seq, "rel_diff": diffs, "tolerance": LINEAR_TOL}
        bad = [f"{k} {v:.3g}" for k, v in diffs.items() if not v <= LINEAR_TOL]
        if bad:
            raise StepFailed(
                Status.FAIL,
                f"te.Linear differs from fp32 F.linear: {', '.join(bad)} (limit {LINEAR_TOL:g})",
                "TE's GEMM path is broken in this environment (cuBLAS/TE build mismatch)",
                step.data,
            )
        step.detail = (
            "bf16 {n}x{n}: rel diff out {out:.2g}, dx {dx:.2g}, dw {dw:.2g}, db {db:.2g}".format(
                n=n, **diffs
            )
        )
    return step


# ------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    # Before TE is imported: TE reads the attention backend switches at import and first use.
    os.environ.update(FUSED_ONLY_ENV)
    build_info_path = _facts.te_build_info_path(args.te_build_info)
    steps: list[Step] = []
    imp, te = step_import()
    steps.append(imp)
    if imp.status in (Status.ERROR, Status.SKIP):
        # TE is there but does not load (or not without a GPU): which cuDNN it was built
        # against, which one is loaded and from where is still the answer, and needs no GPU
        # (torch refusing the loaded cuDNN, or two cuDNN releases meeting, stops TE's import).
        steps.append(step_cudnn(build_info_path))
        steps += [
            Step(n, Status.NOT_RUN, detail=f"not run: import ended '{imp.status.value}'")
            for n in STEP_NAMES[2:]
        ]
    elif imp.status != Status.PASS:
        steps += [
            Step(n, Status.NOT_RUN, detail=f"not run: import ended '{imp.status.value}'")
            for n in STEP_NAMES[1:]
        ]
    else:
        steps.append(step_cudnn(build_info_path))
        steps.append(step_fused_attention(te, args))
        steps.append(step_linear(te, args))
    code = exit_code_of(steps, args.require)
    versions: dict[str, Any] = {"python": sys.version.split()[0]}
    torch_dist = _facts.dist_version("torch")
    versions["torch"] = torch_dist[1] if torch_dist else None
    versions["transformer_engine"] = imp.data.get("version")
    versions["te_build_info"] = _facts.read_json_file(build_info_path)
    report = build_report("check_te", steps, code, require=bool(args.require), versions=versions)
    report["environment"] = _venv_record.environment_facts()
    header = [f"te-build.json: {build_info_path}"]
    print(render_table("check_te", header, steps, code), flush=True)
    if args.json:
        write_report(args.json, report)
    return code


def main(argv: list[str] | None = None) -> int:
    return cli.run(PROG, parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
