#!/usr/bin/env python3
"""upstream_test: run a backend's own upstream test as the oracle for check_ep's verdict.

Why this exists: check_ep's verdict must be true, and the best witness of whether a DeepEP
build works on a machine is DeepEP's own test suite run on the same GPU in the same job. This
script runs that suite from a checkout of the backend's pinned commit (never copied into this
project) and writes its verdict as JSON beside check_ep's, so the two can be compared:

  DeepEP v1   tests/test_intranode.py (v1 layout, commit 567632dd)  exact counts, combine
              calc_diff < 5e-6
  HybridEP    tests/test_hybrid_ep.py (hybrid-ep branch)            dispatch bitwise, combine
              atol 2e-5 rtol 1e-2
  DeepEP v2   tests/elastic/test_ep.py                              combine bitwise

(which test belongs to which backend is the registry's ``upstream_test``).

The test's checks and inputs are untouched. With ``--shared-gpu`` (several ranks on fewer
GPUs) the one function upstream asks users to rewrite, ``init_dist`` in tests/utils.py ("you
may rewrite this function with your own cluster settings"), is replaced in a temporary copy
by one that uses a gloo group and places ranks round-robin on the visible GPUs, since NCCL
refuses two ranks on one GPU. DeepEP v2 builds NCCL communicators and cannot share a GPU.

  upstream-test --backend NAME --tests DeepEP/tests \\
      --num-processes 2 --shared-gpu --shape deepseek-v3 --json out.json
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ep_image import backends as registry
from ep_image import child_env, cli
from ep_image.probes import _venv_record
from ep_image.probes._report import write_json_atomic

PROG = "upstream_test"

#: MoE layer shapes of the models these backends train: tokens per rank, hidden, experts, top-k.
SHAPES = {
    "deepseek-v3": (4096, 7168, 256, 8),
    "qwen3-30b-a3b": (4096, 2048, 128, 8),
}


@dataclass(frozen=True)
class UpstreamTest:
    """Where a backend's own test lives in its repository (under tests/)."""

    path: str
    shares_gpu: bool  # False: it builds NCCL communicators


#: From the registry (ep_image/backends/): each backend's own test and whether it can share a GPU.
TESTS = {
    s.name: UpstreamTest(s.upstream_test, s.shares_gpu) for s in registry.SPECS if s.upstream_test
}

SHARED_INIT_DIST = """def init_dist(local_rank: int, num_local_ranks: int):
    # Rewritten by ep-image's ep_image/probes/upstream_test.py for ranks that share GPUs: a gloo
    # group (NCCL refuses two ranks on one GPU), ranks placed round-robin on the GPUs.
    ip = os.getenv('MASTER_ADDR', '127.0.0.1')
    port = int(os.getenv('MASTER_PORT', '8361'))
    dist.init_process_group(backend='gloo', init_method=f'tcp://{ip}:{port}',
                            world_size=num_local_ranks, rank=local_rank)
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device('cuda')
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    return dist.get_rank(), dist.get_world_size(), dist.new_group(list(range(num_local_ranks)))
"""


#: A sitecustomize.py for the test's processes (its ranks included): at exit each writes what it
#: loaded from outside its venv, so the report shows the oracle ran on the venv's own stack.
LOADED_HOOK = """import atexit, json, os


def _ep_image_record_loaded():
    from ep_image.probes import _venv_record
    path = os.path.join({out!r}, f"{{os.getpid()}}.json")
    with open(path, "w") as handle:
        json.dump(_venv_record.loaded_outside(allowed=({work!r},)), handle)


atexit.register(_ep_image_record_loaded)
"""


def merged_loads(folder: Path) -> dict[str, object]:
    """The union over the test's processes of what each loaded from outside the venv."""
    objects: set[str] = set()
    modules: set[str] = set()
    count = 0
    for path in folder.glob("*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        count += 1
        objects.update(data.get("shared_objects", []))
        modules.update(data.get("modules", []))
    return {"shared_objects": sorted(objects), "modules": sorted(modules), "processes": count}


def rewrite_init_dist(utils_source: str) -> str:
    """``utils_source`` with its ``init_dist`` function replaced by the shared-GPU one."""
    tree = ast.parse(utils_source)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "init_dist":
            lines = utils_source.splitlines(keepends=True)
            start = node.lineno - 1 - len(node.decorator_list)
            return "".join(lines[:start]) + SHARED_INIT_DIST + "".join(lines[node.end_lineno :])
    raise SystemExit("upstream_test: tests/utils.py has no init_dist() to adapt")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.Parser(
        prog="upstream_test.py",
        description="Run a backend's own upstream test (the oracle for check_ep) and write "
        "its verdict as JSON.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("--backend", required=True, choices=sorted(TESTS))
    parser.add_argument(
        "--tests", required=True, type=Path, help="the tests/ folder of the backend's checkout"
    )
    parser.add_argument("--commit", default="", help="the checkout's commit, for the report")
    parser.add_argument("--num-processes", type=int, default=2, help="ranks (default: 2)")
    parser.add_argument(
        "--shared-gpu",
        action="store_true",
        help="ranks share the visible GPUs over a gloo group (init_dist adapted)",
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), help="the MoE layer shape")
    parser.add_argument("--timeout", type=float, default=540.0, help="seconds (default: 540)")
    parser.add_json("write the verdict here")
    parser.add_argument("extra", nargs="*", help="more flags for the test, after --")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return cli.run(PROG, parse_args, run, argv)


def run(args: argparse.Namespace) -> int:
    test = TESTS[args.backend]
    if args.shared_gpu and not test.shares_gpu:
        raise cli.UsageError(
            f"{args.backend}'s test builds NCCL communicators, and NCCL refuses two ranks on "
            "one GPU: run it without --shared-gpu on one GPU per rank"
        )
    source = args.tests / test.path
    if not source.is_file():
        raise cli.UsageError(f"{source} not found (need the backend's tests/)")
    work = Path(tempfile.mkdtemp(prefix="upstream-test-"))
    try:
        shutil.copytree(args.tests, work / "tests")
        utils = work / "tests" / "utils.py"
        if args.shared_gpu:
            utils.write_text(rewrite_init_dist(utils.read_text()))
        flags, env_extra = (
            registry.spec(args.backend).upstream_shape_arguments(
                SHAPES[args.shape], args.num_processes
            )
            if args.shape
            else ([], {})
        )
        cmd = [
            sys.executable,
            str(work / "tests" / test.path),
            "--num-processes",
            str(args.num_processes),
            *flags,
            *args.extra,
        ]
        # child_env: the hook imports this ep_image, where the venv does not hold it.
        env = child_env(
            {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
        )
        env.update(env_extra)
        hook, loads = work / "hook", work / "loaded"
        hook.mkdir()
        loads.mkdir()
        hook_text = LOADED_HOOK.format(out=str(loads), work=str(work))
        (hook / "sitecustomize.py").write_text(hook_text)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hook), env.get("PYTHONPATH")]))
        env.pop("WORLD_SIZE", None)
        env.pop("RANK", None)
        start = time.monotonic()
        try:
            proc = subprocess.run(
                cmd,
                cwd=work / "tests" / Path(test.path).parent,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=args.timeout,
            )
            code, output = proc.returncode, proc.stdout
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout
            code, output = 124, out.decode() if isinstance(out, bytes) else (out or "")
        seconds = time.monotonic() - start
        environment = _venv_record.venv_record()
        environment["loaded_outside_venv"] = merged_loads(loads)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    sys.stdout.write(output)
    verdict = "passed" if code == 0 else ("timeout" if code == 124 else "failed")
    report = {
        "probe": "upstream_test",
        "backend": args.backend,
        "test": f"tests/{test.path}",
        "commit": args.commit or None,
        "num_processes": args.num_processes,
        "shared_gpu": args.shared_gpu,
        "init_dist": "rewritten: gloo, round-robin GPUs" if args.shared_gpu else "upstream",
        "shape": dict(zip(("tokens", "hidden", "experts", "topk"), SHAPES[args.shape], strict=True))
        if args.shape
        else None,
        "command": cmd[1:],
        "exit_code": code,
        "result": verdict,
        "seconds": round(seconds, 1),
        "cases_passed": cases_passed(output, code == 0),
        "cases_completed": cases_completed(output, code == 0),
        "output_tail": output[-4000:],
        "environment": environment,
    }
    if args.json:
        write_json_atomic(args.json, report)
    print(
        f"upstream_test: {args.backend} {test.path} x{args.num_processes}: {verdict} "
        f"(exit {code}, {seconds:.0f} s)"
    )
    return 0 if code == 0 else 1


def _printed_passes(output: str) -> int:
    """The "passed" lines a test prints per case (DeepEP v1's and HybridEP's)."""
    return len(re.findall(r"\bpass(?:ed)?\b", output, re.IGNORECASE))


def _announced_completed(output: str, finished: bool) -> int:
    """DeepEP v2's test announces each case with "> Testing with ..." and asserts on it before
    the next one starts, so every announced case but a cut-off last one completed."""
    started = len(re.findall(r"^\s*> Testing with", output, re.MULTILINE))
    return started if finished else max(started - 1, 0)


def cases_passed(output: str, finished: bool) -> int:
    """Cases known to have passed: printed as passed, or completed (each asserts before the next
    starts)."""
    return max(_printed_passes(output), _announced_completed(output, finished))


def cases_completed(output: str, finished: bool) -> int:
    """Cases that ran through their checks: announced and finished, or printed as passed (a
    case that passed completed; v1's and HybridEP's tests announce none, and read 0 here)."""
    return max(_announced_completed(output, finished), _printed_passes(output))


if __name__ == "__main__":
    sys.exit(main())
