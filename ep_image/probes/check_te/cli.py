"""check_te's command: its flags, the order of its steps, its table and JSON report.

Why this module exists: the steps stand beside it, one a module (``import_step``,
``cudnn_step``, ``gpu_steps``); this is where they are run in order and judged together.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from ep_image import cli
from ep_image.probes import _installed, _te, _venv_record
from ep_image.probes._report import (
    Status,
    Step,
    build_report,
    exit_code_of,
    render_table,
    write_report,
)
from ep_image.probes.check_te.cudnn_step import step_cudnn
from ep_image.probes.check_te.gpu_steps import FUSED_ONLY_ENV, step_fused_attention, step_linear
from ep_image.probes.check_te.import_step import step_import

PROG = "check_te"
STEP_NAMES = ("import", "cudnn", "fused_attention", "linear")


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
        help="te-build.json written by build_te.py (default: $EP_TE_BUILD_INFO, else the one in "
        f"the directory holding this venv, else {_te.DEFAULT_TE_BUILD_INFO}, else none)",
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


def run(args: argparse.Namespace) -> int:
    # Before TE is imported: TE reads the attention backend switches at import and first use.
    os.environ.update(FUSED_ONLY_ENV)
    build_info_path = _te.te_build_info_path(args.te_build_info)
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
    torch_dist = _installed.dist_version("torch")
    versions["torch"] = torch_dist[1] if torch_dist else None
    versions["transformer_engine"] = imp.data.get("version")
    versions["te_build_info"] = _te.read_json_file(build_info_path) if build_info_path else None
    report = build_report("check_te", steps, code, require=bool(args.require), versions=versions)
    report["environment"] = _venv_record.environment_facts()
    header = [f"te-build.json: {build_info_path or _te.no_te_build_info()}"]
    print(render_table("check_te", header, steps, code), flush=True)
    if args.json:
        write_report(args.json, report)
    return code


def main(argv: list[str] | None = None) -> int:
    return cli.run(PROG, parse_args, run, argv)
