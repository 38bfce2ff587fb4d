#!/usr/bin/env python3
"""check_ep: prove that an expert-parallel (EP) backend works, not just that it imports.

Why this probe exists: an image can import DeepEP and still fault at its first dispatch, route
tokens differently on an activation-checkpoint replay, or run at a fraction of the expected
bandwidth. This probe drives the backend the way an MoE layer does, on the real process
group, and checks every result against a reference computed independently in plain torch:

  import            which distribution provides ``deep_ep``, its version, commit, build info
  prerequisites     GPU, CUDA home + nvcc (JIT backends), NCCL, NVSHMEM, supported world size
  buffer            the backend's buffer, sized from --tokens/--hidden/--experts/--topk
  dispatch_combine  tokens reach the right ranks and experts, payloads intact, combine
                    returns the top-k weighted sum
  backward          gradient through dispatch and combine equals the analytic one
  replay            repeated dispatch of the same routing returns the same counts
  bandwidth         dispatch and combine GB/s after warm-up, beside a device copy's GB/s

Run it as a plain process (one rank), under ``torchrun --nproc-per-node N``, or with
``--nproc-per-node N`` to let the probe start N local ranks itself (its exit code then
survives: torchrun turns every failure into 1). See docs/probes.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _ep_detect
import _facts
import _supervise
from _report import (
    EXIT_MISSING,
    EXIT_OK,
    EXIT_SKIPPED,
    EXIT_UNUSABLE,
    EXIT_USAGE,
    ProbeArgumentParser,
    Status,
    Step,
    StepFailed,
    UsageError,
    build_report,
    exit_code_of,
    one_line,
    render_table,
    timed_step,
    worst,
    write_json_atomic,
)

if TYPE_CHECKING:
    from ep_adapters import EPBackend, Shape

PROG = "check_ep"
STEP_NAMES = (
    "import",
    "prerequisites",
    "buffer",
    "dispatch_combine",
    "backward",
    "replay",
    "bandwidth",
)
GATES = ("import", "prerequisites", "buffer")
BACKEND_CHOICES = ("auto", *_ep_detect.BACKEND_NAMES, _ep_detect.REFERENCE_BACKEND)

#: Default layer shape: a DeepSeek-V3-like MoE layer on GPU, a small one on CPU.
GPU_DEFAULTS = {"tokens": 4096, "hidden": 7168, "experts": 256, "topk": 8}
CPU_DEFAULTS = {"tokens": 256, "hidden": 512, "experts": 32, "topk": 4}

# Exit codes ordered by severity, for merging codes of several processes.
_CODE_SEVERITY = {
    EXIT_OK: 0,
    EXIT_SKIPPED: 1,
    1: 2,
    EXIT_UNUSABLE: 3,
    EXIT_MISSING: 4,
    EXIT_USAGE: 5,
}


# ------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ProbeArgumentParser(
        prog="check_ep.py",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Prove that an expert-parallel backend works on this machine: build its buffer, "
            "run dispatch and combine on random MoE routing, and check counts, payloads, the "
            "combined sum, gradients, replay determinism and bandwidth against a plain-torch "
            "reference."
        ),
        epilog="""\
how to run:
  python probes/check_ep.py                                 one rank (DeepEP v1 needs 2+)
  torchrun --nproc-per-node 8 probes/check_ep.py --json out.json
  python probes/check_ep.py --nproc-per-node 4 --backend torch   starts 4 local ranks itself

exit codes (all ranks agree):
  0 all passed   1 a check failed (wrong numbers)   2 bad usage
  3 backend unusable (imports, fails at run time)   4 backend missing
  5 this environment cannot run it (skipped; --require turns it into 1)

under torchrun, torchrun itself exits 1 for any non-zero code; the probe's own code is in
the table's last line and in the JSON report's exit_code.
""",
    )
    parser.add_argument(
        "--backend",
        default="auto",
        metavar="NAME",
        help="backend to check: auto, deepep_v1, deepep_v2, hybridep or torch (the built-in "
        "all_gather reference). auto picks the one installed here, torch if none "
        "(default: auto)",
    )
    parser.add_argument(
        "--backend-class",
        metavar="FILE.py:Class",
        help="check an EPBackend subclass from a file or module instead (FILE.py:Class or "
        "package.module:Class); used by the tests to inject broken backends",
    )
    shape = parser.add_argument_group(
        "layer shape (defaults: GPU 4096/7168/256/8, CPU 256/512/32/4)"
    )
    shape.add_argument("--tokens", type=int, help="tokens per rank")
    shape.add_argument("--hidden", type=int, help="hidden size of a token")
    shape.add_argument("--experts", type=int, help="experts over all ranks (divisible by ranks)")
    shape.add_argument("--topk", type=int, help="experts per token (<= experts)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "bfloat16", "float32", "float16"),
        help="token dtype; auto: bfloat16 on GPU, float32 on CPU. DeepEP backends take "
        "bfloat16 only (default: auto)",
    )
    parser.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cuda", "cpu"),
        help="where the torch backend runs; auto: cuda when a GPU is visible. DeepEP backends "
        "always need cuda (default: auto)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument(
        "--replays",
        type=int,
        default=3,
        help="extra dispatches of the same routing for the replay check (default: 3)",
    )
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations (default: 5)")
    parser.add_argument("--iters", type=int, default=20, help="timed iterations (default: 20)")
    parser.add_argument(
        "--tolerance",
        type=float,
        help="largest relative difference accepted for combine and gradients "
        "(default: 5e-6 for float32, 1e-2 for bfloat16/float16)",
    )
    parser.add_argument(
        "--min-gbs",
        type=float,
        default=0.0,
        help="fail when dispatch or combine is slower than this many GB/s (default: 0, off)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds before a stuck collective is abandoned (default: 300)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the machine-readable report here")
    parser.add_argument(
        "--require",
        action="store_true",
        help="treat 'cannot run here' (exit 5) as a failure (exit 1): for CI on GPU runners",
    )
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=0,
        metavar="N",
        help="start N local ranks (no torchrun needed) and exit with their agreed code",
    )
    return parser.parse_args(argv)


@dataclass(frozen=True)
class RankEnv:
    """This process's place in the job, from torchrun's environment (one rank without it)."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    launched: bool  # WORLD_SIZE and MASTER_ADDR present: use env:// rendezvous

    @classmethod
    def from_environ(cls) -> RankEnv:
        env = os.environ
        world = int(env.get("WORLD_SIZE", "1"))
        return cls(
            rank=int(env.get("RANK", "0")),
            world=world,
            local_rank=int(env.get("LOCAL_RANK", "0")),
            local_world=int(env.get("LOCAL_WORLD_SIZE", str(world))),
            launched="WORLD_SIZE" in env and "MASTER_ADDR" in env,
        )


def validate_static(args: argparse.Namespace, world: int) -> None:
    """Flag checks that need no torch: positive sizes, top-k vs experts, divisibility."""
    if args.backend not in BACKEND_CHOICES:
        raise UsageError(
            f"unknown backend {args.backend!r}; choose one of {', '.join(BACKEND_CHOICES)}"
        )
    if args.backend_class and args.backend != "auto":
        raise UsageError("--backend-class replaces --backend; pass only one of them")
    if args.backend_class:
        target = args.backend_class.rpartition(":")[0]
        if (target.endswith(".py") or "/" in target) and not Path(target).is_file():
            raise UsageError(f"--backend-class: file not found: {target}")
    for name in ("tokens", "hidden", "experts", "topk"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise UsageError(f"--{name} must be a positive integer, got {value}")
    for name in ("replays", "iters"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise UsageError(f"--warmup must be >= 0, got {args.warmup}")
    if args.timeout <= 0:
        raise UsageError(f"--timeout must be positive, got {args.timeout}")
    if args.tolerance is not None and args.tolerance <= 0:
        raise UsageError(f"--tolerance must be positive, got {args.tolerance}")
    if args.nproc_per_node < 0:
        raise UsageError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    validate_shape(args.tokens, args.hidden, args.experts, args.topk, world)


def validate_shape(
    tokens: int | None, hidden: int | None, experts: int | None, topk: int | None, world: int
) -> None:
    """The layer shape must be routable: top-k <= experts, experts split evenly over ranks."""
    from_ref_limits = (65536, 3, 256)  # token ids, id columns, ranks (see _ep_reference)
    if topk is not None and experts is not None and topk > experts:
        raise UsageError(f"--topk {topk} is larger than --experts {experts}")
    if experts is not None and experts % world != 0:
        raise UsageError(
            f"--experts {experts} is not divisible by the world size {world}: every rank "
            "must own the same number of experts"
        )
    if tokens is not None and tokens > from_ref_limits[0]:
        raise UsageError(f"--tokens {tokens} is above the probe's limit of 65536 per rank")
    if hidden is not None and hidden < 8:
        raise UsageError(f"--hidden {hidden} is too small: the probe needs at least 8 columns")
    if world > from_ref_limits[2]:
        raise UsageError(f"world size {world} is above the probe's limit of 256 ranks")


# ------------------------------------------------------------------------------------------
# Local launcher (--nproc-per-node)
# ------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _strip_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
            continue
        if item == "--nproc-per-node":
            skip = True
            continue
        if item.startswith("--nproc-per-node="):
            continue
        out.append(item)
    return out


def merge_exit_codes(codes: list[int]) -> int:
    """The most severe of several processes' exit codes; a crash (signal) counts as 3."""
    merged = EXIT_OK
    for code in codes:
        code = EXIT_UNUSABLE if code < 0 or code not in _CODE_SEVERITY else code
        if _CODE_SEVERITY[code] > _CODE_SEVERITY[merged]:
            merged = code
    return merged


def _rank_environ(rank: int, nproc: int, port: int) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def launch_local(nproc: int, argv: list[str], timeout: float) -> int:
    """Start ``nproc`` ranks of this probe on this host and return their agreed exit code.

    The ranks are forked after torch is imported once (nothing touches CUDA before the
    fork, so each rank initialises its own GPU), which saves each rank the seconds a torch
    import costs; where fork is unavailable they are started as fresh interpreters.
    """
    port = _free_port()
    child_argv = _strip_nproc(argv)
    if hasattr(os, "fork"):
        import torch  # imported once, inherited by every forked rank

        sys.stdout.flush()
        sys.stderr.flush()
        pids: list[int] = []
        for rank in range(nproc):
            pid = os.fork()
            if pid == 0:  # the rank
                code = EXIT_UNUSABLE
                try:
                    os.environ.update(_rank_environ(rank, nproc, port))
                    # As torchrun does: one intra-op thread per rank unless the user set it,
                    # so N ranks do not oversubscribe the cores.
                    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
                    code = main(child_argv)
                except BaseException as exc:
                    print(f"{PROG}: rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            pids.append(pid)
        return _wait_ranks(pids, timeout)
    procs = [
        subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), *child_argv],
            env={"OMP_NUM_THREADS": "1", **os.environ, **_rank_environ(rank, nproc, port)},
        )
        for rank in range(nproc)
    ]
    return _wait_ranks([p.pid for p in procs], timeout)


def _stop(pids: list[int], codes: dict[int, int], grace: float = 10.0) -> None:
    """SIGTERM the ranks still running (their supervisors pass it on), SIGKILL after ``grace``."""
    left = [pid for pid in pids if pid not in codes]
    for pid in left:
        os.kill(pid, signal.SIGTERM)
    end = time.monotonic() + grace
    while left and time.monotonic() < end:
        for pid in list(left):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
                left.remove(pid)
        time.sleep(0.05)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
        codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _wait_ranks(pids: list[int], timeout: float) -> int:
    """Wait for the ranks; when one ends badly, give the rest ``timeout`` + 30 s, then kill."""
    codes: dict[int, int] = {}
    deadline: float | None = None
    while len(codes) < len(pids):
        for pid in pids:
            if pid in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
                if codes[pid] != 0 and deadline is None:
                    deadline = time.monotonic() + timeout + 30
        if deadline is not None and time.monotonic() > deadline:
            _stop(pids, codes)
        time.sleep(0.05)
    return merge_exit_codes(list(codes.values()))


# ------------------------------------------------------------------------------------------
# Backend selection (before torch is imported, so "missing" answers fast)
# ------------------------------------------------------------------------------------------


@dataclass
class Selection:
    """Which backend to check and why; ``verdict`` is set when nothing can run."""

    name: str
    how: str
    installed: _ep_detect.Installed | None
    verdict: Step | None = None
    custom: bool = False


def select_backend(args: argparse.Namespace) -> Selection:
    """Resolve --backend against what is installed; a requested-but-absent one is MISSING."""
    if args.backend_class:
        return Selection("custom", f"--backend-class {args.backend_class}", None, custom=True)
    if args.backend == "torch":
        return Selection("torch", "requested", None)
    installed = _ep_detect.detect_installed()
    if args.backend == "auto":
        if installed.module_dir is None:
            return Selection(
                "torch", "auto: no deep_ep installed, using the torch reference", installed
            )
        if installed.backend is None:
            step = Step(
                "import",
                Status.ERROR,
                detail=f"auto: {installed.reason}",
                hint="install one of deepep_v1, deepep_v2, hybridep, or pass --backend torch",
            )
            return Selection("unknown", "auto", installed, step)
        return Selection(installed.backend, f"auto: {installed.reason}", installed)
    if installed.backend == args.backend:
        return Selection(args.backend, f"requested; {installed.reason}", installed)
    if installed.module_dir is None:
        detail = f"{args.backend} requested but not installed: {installed.reason}"
    else:
        detail = (
            f"{args.backend} requested but this environment holds "
            f"{installed.backend or 'an unknown deep_ep'} ({installed.reason})"
        )
    step = Step(
        "import", Status.MISSING, detail=detail, hint=_ep_detect.INSTALL_HINTS[args.backend]
    )
    return Selection(args.backend, "requested", installed, step)


# ------------------------------------------------------------------------------------------
# Distributed set-up and agreement
# ------------------------------------------------------------------------------------------


@dataclass
class Runtime:
    """Process groups and placement for one run."""

    env: RankEnv
    device: Any  # torch.device
    use_gpu: bool
    ep_group: Any  # dist.ProcessGroup
    ctrl_group: Any  # gloo group for agreement, never the backend's
    timeout: float  # seconds, for collectives and the trial import


def init_distributed(env: RankEnv, use_gpu: bool, timeout: float) -> Runtime:
    """Default group on NCCL (GPU) or gloo (CPU); a gloo group for the probe's own messages."""
    import datetime

    import torch
    import torch.distributed as dist

    backend = "nccl" if use_gpu else "gloo"
    kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout)}
    if use_gpu:
        torch.cuda.set_device(env.local_rank)
        device = torch.device("cuda", env.local_rank)
        kwargs["device_id"] = device  # eager NCCL init, so DeepEP can reuse the communicator
    else:
        device = torch.device("cpu")
    if env.launched:
        dist.init_process_group(backend, init_method="env://", **kwargs)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    ctrl = dist.new_group(backend="gloo", timeout=kwargs["timeout"])
    return Runtime(env, device, use_gpu, dist.group.WORLD, ctrl, timeout)


def all_gather_json(obj: Any, group: Any, world: int) -> list[Any]:
    """Every rank's JSON-able ``obj``, in rank order.

    Not ``dist.all_gather_object``: that decodes through ``Tensor.numpy()``, and the backend
    venvs (and images) hold no numpy. Bytes travel as uint8 tensors over the gloo group.
    """
    import torch
    import torch.distributed as dist

    payload = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64), group=group)
    longest = max(int(n.item()) for n in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    chunks = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(chunks, padded, group=group)
    return [
        json.loads(bytes(chunk[: int(n.item())].tolist()).decode())
        for chunk, n in zip(chunks, sizes, strict=True)
    ]


def agree(
    rt: Runtime, step: Step, summarize: Callable[[Step, list[Step]], None] | None = None
) -> Step:
    """Merge one step over all ranks: worst status wins, its first rank's detail is shown."""
    gathered = all_gather_json(step.to_json(), rt.ctrl_group, rt.env.world)
    per_rank = [Step.from_json(obj) for obj in gathered]
    status = worst(s.status for s in per_rank)
    merged = Step(step.name, status, seconds=max(s.seconds for s in per_rank))
    if status in (Status.PASS, Status.INFO):
        merged.detail, merged.hint, merged.data = per_rank[0].detail, "", dict(per_rank[0].data)
    else:
        bad = [i for i, s in enumerate(per_rank) if s.status == status]
        first = per_rank[bad[0]]
        prefix = f"rank {bad[0]}: " if rt.env.world > 1 else ""
        more = f" (and {len(bad) - 1} more ranks)" if len(bad) > 1 else ""
        merged.detail = one_line(prefix + first.detail + more)
        merged.hint = first.hint
        merged.data = dict(first.data)
    if rt.env.world > 1:
        merged.data["ranks"] = [s.data for s in per_rank]
    if summarize is not None:
        summarize(merged, per_rank)
    return merged


# ------------------------------------------------------------------------------------------
# Steps
# ------------------------------------------------------------------------------------------


def step_import(rt: Runtime, sel: Selection, backend: EPBackend) -> Step:
    """Find, trial-import (in a child process) and import the backend; report its identity."""
    import torch

    with timed_step("import") as step:
        data: dict[str, Any] = {"backend": sel.name, "how": sel.how}
        data["torch"] = torch.__version__
        data["torch_cuda"] = torch.version.cuda
        cuda_major = int(torch.version.cuda.split(".")[0]) if torch.version.cuda else None
        data["cuda_major"] = cuda_major
        inst = sel.installed
        if inst is not None and inst.module_dir is not None and sel.name != "torch":
            data.update(
                module_dir=inst.module_dir,
                distribution=inst.distribution,
                version=inst.version,
                commit=inst.commit,
                build_info=inst.build_info,
            )
            expected_major = inst.build_info.get("EXPECTED_CUDA_MAJOR")
            if (
                expected_major is not None
                and cuda_major is not None
                and expected_major != cuda_major
            ):
                raise StepFailed(
                    Status.ERROR,
                    f"{inst.distribution} {inst.version} is built for CUDA {expected_major}, "
                    f"torch uses CUDA {cuda_major}",
                    "install the torch build for the backend's CUDA (cu130 for the pinned wheels)",
                    data,
                )
            if rt.env.local_rank == 0:
                trial = _ep_detect.trial_import(timeout=max(rt.timeout * 0.8, 60.0))
                if not trial.ok:
                    status, detail, hint = _ep_detect.classify_import_failure(
                        sel.name, trial.output, trial.returncode, torch.cuda.is_available()
                    )
                    data["import_output_tail"] = trial.output[-2000:]
                    raise StepFailed(status, detail, hint, data)
        step.data = data
    merged = agree(rt, step)
    if merged.status != Status.PASS:
        return merged

    # Every rank imports in-process only after the trial import passed everywhere.
    with timed_step("import") as step:
        step.data = dict(merged.data)
        step.data.pop("ranks", None)
        step.data.update(backend.load())
        step.detail = _import_detail(sel, step.data)
    return agree(rt, step)


def _import_detail(sel: Selection, data: dict[str, Any]) -> str:
    if sel.name == "torch":
        return f"built-in all_gather reference backend; torch {data['torch']}"
    if sel.custom:
        return f"{sel.how}; torch {data['torch']}"
    parts = [f"{data.get('distribution')} {data.get('version')}"]
    if data.get("commit"):
        parts.append(f"commit {data['commit']}")
    parts.append(f"at {data.get('module_path') or data.get('module_dir')}")
    if data.get("build_info"):
        parts.append("build " + ", ".join(f"{k}={v}" for k, v in data["build_info"].items()))
    parts.append(f"CUDA {data.get('torch_cuda')}")
    return "; ".join(parts)


def step_prerequisites(rt: Runtime, backend: EPBackend) -> Step:
    """GPU, world size, CUDA home + nvcc for JIT backends, NCCL and NVSHMEM versions.

    Every fact is gathered first, so the report shows all of them even when one problem
    ends the step; the most severe problem decides its status.
    """
    with timed_step("prerequisites") as step:
        data: dict[str, Any] = {"world_size": rt.env.world}
        notes: list[str] = []
        problems: list[tuple[Status, str, str]] = []
        _check_gpus(rt, backend, data, notes, problems)
        if backend.world_sizes is not None and rt.env.world not in backend.world_sizes:
            problems.append(
                (
                    Status.SKIP,
                    f"{backend.name} cannot run on {rt.env.world} rank(s)",
                    backend.world_size_note or f"run with {backend.world_sizes} ranks",
                )
            )
        if backend.jit_compiles:
            _check_cuda_home(backend, data, notes, problems)
        _check_nccl(rt, backend, data, notes, problems)
        _report_nvshmem(backend, data, notes)
        step.data = data
        step.detail = "; ".join(notes)
        if problems:
            status, detail, hint = max(problems, key=lambda p: p[0].severity)
            raise StepFailed(status, detail + " (" + step.detail + ")", hint, data)
    return agree(rt, step)


Problems = list[tuple[Status, str, str]]


def _check_gpus(
    rt: Runtime, backend: EPBackend, data: dict[str, Any], notes: list[str], problems: Problems
) -> None:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    data["gpus_visible"] = gpus
    if not (backend.requires_gpu or rt.use_gpu):
        notes.append("CPU over gloo (no GPU needed)")
        return
    if gpus == 0:
        problems.append(
            (
                Status.SKIP,
                f"{backend.name} needs a GPU and none is visible",
                "no GPU visible: run on a GPU node or pass --backend torch",
            )
        )
        notes.append("no GPU")
        return
    if gpus < rt.env.local_world:
        problems.append(
            (
                Status.SKIP,
                f"{rt.env.local_world} local ranks but only {gpus} GPUs visible",
                "start at most one rank per GPU (torchrun --nproc-per-node <= GPUs)",
            )
        )
    data["gpu"] = torch.cuda.get_device_name(rt.device) if rt.use_gpu else None
    notes.append(f"{gpus}x {data['gpu'] or 'GPU'}")


def _check_cuda_home(
    backend: EPBackend, data: dict[str, Any], notes: list[str], problems: Problems
) -> None:
    home, how = _facts.cuda_home()
    nvcc, nvcc_ver = _facts.nvcc_version(home)
    data.update(cuda_home=home, cuda_home_from=how, nvcc=nvcc, nvcc_version=nvcc_ver)
    why = f"{backend.name} JIT-compiles its kernels at run time"
    if home is None or nvcc is None:
        problems.append(
            (
                Status.ERROR,
                f"CUDA home {'not found' if home is None else home + ' has no nvcc'}",
                f"CUDA home not found: set CUDA_HOME to a CUDA 13 toolkit with nvcc; {why}",
            )
        )
        notes.append("no CUDA home/nvcc")
        return
    if not (Path(home) / "include" / "cuda_runtime.h").is_file():
        problems.append(
            (
                Status.ERROR,
                f"CUDA home {home} ({how}) has no include/cuda_runtime.h",
                "set CUDA_HOME to the CUDA 13 toolkit root (the directory holding bin/nvcc "
                f"and include/); {why}",
            )
        )
    notes.append(f"CUDA home {home} (nvcc {nvcc_ver})")


def _check_nccl(
    rt: Runtime, backend: EPBackend, data: dict[str, Any], notes: list[str], problems: Problems
) -> None:
    nccl = _facts.torch_facts()["nccl"] if rt.use_gpu else None
    nccl_dist = _facts.dist_version("nvidia-nccl-cu13", "nvidia-nccl-cu12")
    data["nccl"] = nccl
    data["nccl_dist"] = f"{nccl_dist[0]} {nccl_dist[1]}" if nccl_dist else None
    if nccl:
        notes.append(f"NCCL {nccl}")
    if backend.min_nccl is not None and _facts.version_at_least(nccl, backend.min_nccl) is False:
        need = ".".join(map(str, backend.min_nccl))
        problems.append(
            (
                Status.ERROR,
                f"NCCL {nccl} loaded, {backend.name} needs >= {need}",
                _ep_detect.NCCL_FIX,
            )
        )


def _report_nvshmem(backend: EPBackend, data: dict[str, Any], notes: list[str]) -> None:
    """NVSHMEM is reported, not required: the intranode paths checked here do not use it.

    DeepEP v1 (and the hybrid-ep branch's v1 kernels) silently build without NVSHMEM when
    neither NVSHMEM_DIR nor the nvidia-nvshmem wheel was there at build time, which disables
    their internode and low-latency kernels; whether the extension links libnvshmem_host
    tells which build this is.
    """
    nvshmem = _facts.dist_version("nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12")
    data["nvshmem_dist"] = f"{nvshmem[0]} {nvshmem[1]}" if nvshmem else None
    data["nvshmem_dir"] = os.environ.get("NVSHMEM_DIR")
    data["nvshmem_mapped"] = _facts.mapped_libraries(r"^libnvshmem")
    if not backend.requires_gpu:
        return
    found = nvshmem[1] if nvshmem else data["nvshmem_dir"]
    text = f"NVSHMEM {found}" if found else "NVSHMEM not found"
    extension = _facts.extension_path("deep_ep_cpp") if backend.name in _NVSHMEM_BUILDS else None
    if extension:
        linked = _facts.file_contains(extension, b"libnvshmem_host")
        data["nvshmem_linked_by"] = extension if linked else None
        text += (
            ", linked by deep_ep_cpp"
            if linked
            else ", not linked by deep_ep_cpp (built without it: internode and low-latency "
            "kernels disabled)"
        )
    notes.append(text)


_NVSHMEM_BUILDS = ("deepep_v1", "hybridep")


def step_buffer(rt: Runtime, backend: EPBackend, shape: Shape) -> Step:
    """Construct the backend's buffer on the EP group."""
    import torch.distributed as dist

    with timed_step("buffer") as step:
        _sync(rt)
        dist.barrier(group=rt.ep_group)
        backend.create(rt.ep_group, shape)
        _sync(rt)
        local = shape.local_experts(rt.env.world)
        step.detail = (
            f"{type(backend).__name__} on {rt.env.world} rank(s): {shape.tokens} tokens/rank, "
            f"hidden {shape.hidden}, {shape.experts} experts ({local}/rank), top-{shape.topk}"
        )
        for attr in ("num_nvl_bytes",):
            if hasattr(backend, attr):
                step.data[attr] = getattr(backend, attr)
    return agree(rt, step)


@dataclass
class CheckContext:
    """Inputs and independent expectations shared by the check steps."""

    shape: Shape
    local: int
    inputs: Any
    global_routing: Any
    expected: Any
    scales: Any
    tolerance: float


def prepare_checks(rt: Runtime, shape: Shape, args: argparse.Namespace) -> CheckContext:
    import _ep_reference as ref

    inputs = ref.make_inputs(shape, rt.env.rank, args.seed)
    g = ref.gather_global(inputs, rt.ep_group)
    local = shape.local_experts(rt.env.world)
    tol = args.tolerance if args.tolerance is not None else ref.tolerance_for(shape.dtype)
    return CheckContext(
        shape=shape,
        local=local,
        inputs=inputs,
        global_routing=g,
        expected=ref.expected_for_rank(g, rt.env.rank, local),
        scales=ref.expert_scales(shape.experts, shape.device),
        tolerance=tol,
    )


def step_dispatch_combine(rt: Runtime, backend: EPBackend, ctx: CheckContext) -> Step:
    """One dispatch and one combine, compared with the all-gathered reference."""
    import _ep_reference as ref

    with timed_step("dispatch_combine") as step:
        inp = ctx.inputs
        d = backend.dispatch(inp.x, inp.topk_idx, inp.topk_weights)
        _sync(rt)
        check = ref.check_dispatch(d, ctx.global_routing, ctx.expected, ctx.local)
        scale = ref.row_scale(
            d.recv_topk_idx, d.recv_topk_weights, ctx.scales, rt.env.rank, ctx.local
        )
        y = (d.recv_x.float() * scale[:, None]).to(d.recv_x.dtype)
        out = backend.combine(y, d.handle)
        _sync(rt)
        diff = ref.rel_diff(out.float(), ref.expected_combine(inp, ctx.scales))
        step.data = {
            "received": check.received,
            "expected": check.expected,
            "per_expert": check.per_expert,
            "expected_per_expert": check.expected_per_expert,
            "rel_diff": diff,
            "tolerance": ctx.tolerance,
        }
        problems = list(check.problems)
        if not diff <= ctx.tolerance:
            problems.append(
                f"combine relative difference {diff:.3g} > {ctx.tolerance:g} "
                f"({_dtype_name(ctx.shape.dtype)}): combine does not return the top-k weighted sum"
            )
        if problems:
            raise StepFailed(
                Status.FAIL,
                "; ".join(problems),
                "the backend routes or reduces tokens wrongly; compare with --backend torch "
                "and report it with this JSON",
                step.data,
            )
        step.detail = f"{check.received} tokens received, counts match; rel diff {diff:.2g}"
    return agree(rt, step, _summarize_dispatch_combine)


def _summarize_dispatch_combine(merged: Step, per_rank: list[Step]) -> None:
    datas = [s.data for s in per_rank]
    if not all("received" in d for d in datas):
        return
    recv = [d["received"] for d in datas]
    diff = max(d["rel_diff"] for d in datas)
    merged.data.update(
        received_per_rank=recv,
        expected_per_rank=[d["expected"] for d in datas],
        received_per_expert=[c for d in datas for c in d["per_expert"]],
        max_rel_diff=diff,
        tolerance=datas[0]["tolerance"],
    )
    if merged.status == Status.PASS:
        merged.detail = (
            f"tokens/rank {recv} match the reference; per-expert counts match; "
            f"max rel diff {diff:.2g} <= {datas[0]['tolerance']:g}"
        )


def step_backward(rt: Runtime, backend: EPBackend, ctx: CheckContext, seed: int) -> Step:
    """Gradient of sum(combine(expert(dispatch(x))) * g) w.r.t. x versus g * sum_k w_k s_k."""
    import _ep_reference as ref
    import torch

    with timed_step("backward") as step:
        inp = ctx.inputs
        x = inp.x.detach().clone().requires_grad_(True)
        box: list[Any] = []
        recv = _DispatchFn.apply(x, backend, inp.topk_idx, inp.topk_weights, box)
        d = box[0]
        scale = ref.row_scale(
            d.recv_topk_idx, d.recv_topk_weights, ctx.scales, rt.env.rank, ctx.local
        )
        y = (recv.float() * scale[:, None]).to(recv.dtype)
        out = _CombineFn.apply(y, backend, d.handle)
        gen = torch.Generator(device=ctx.shape.device)
        gen.manual_seed(seed * 1_000_003 + 7919 * (rt.env.rank + 1))
        g = torch.randn(out.shape, generator=gen, device=ctx.shape.device)
        (out.float() * g).sum().backward()
        _sync(rt)
        grad = x.grad
        expected = g * ref.token_scale(inp, ctx.scales)[:, None]
        diff = ref.rel_diff(grad.float(), expected) if grad is not None else float("inf")
        step.data = {"grad_rel_diff": diff, "tolerance": ctx.tolerance}
        if not diff <= ctx.tolerance:
            raise StepFailed(
                Status.FAIL,
                f"gradient w.r.t. the tokens has relative difference {diff:.3g} > "
                f"{ctx.tolerance:g} from g * sum_k w_k * scale_k",
                "the backward of dispatch (a combine) or of combine (a cached dispatch) is "
                "wrong; training with this backend would learn from wrong gradients",
                step.data,
            )
        step.detail = f"grad rel diff {diff:.2g}"
    return agree(rt, step, _summarize_backward)


def _summarize_backward(merged: Step, per_rank: list[Step]) -> None:
    diffs = [s.data.get("grad_rel_diff") for s in per_rank]
    if all(d is not None for d in diffs):
        merged.data["max_grad_rel_diff"] = max(diffs)
        if merged.status == Status.PASS:
            merged.detail = (
                f"d/dx sum(combine(dispatch(x)) * g) matches the analytic gradient; "
                f"max rel diff {max(diffs):.2g} <= {per_rank[0].data['tolerance']:g}"
            )


def step_replay(rt: Runtime, backend: EPBackend, ctx: CheckContext, replays: int) -> Step:
    """Dispatch the same routing again: rows and per-expert counts must not change."""
    import _ep_reference as ref

    with timed_step("replay") as step:
        inp = ctx.inputs
        rows: list[int] = []
        per_expert: list[list[int]] = []
        token_sets_equal = True
        first_ids = None
        for _ in range(replays + 1):
            d = backend.dispatch(inp.x, inp.topk_idx, inp.topk_weights)
            _sync(rt)
            rows.append(int(d.recv_x.shape[0]))
            per_expert.append([int(c) for c in d.num_recv_per_expert])
            ids = (
                ref.decode_ids(d.recv_x, ctx.global_routing.tokens, ctx.global_routing.world)
                .sort()
                .values
            )
            if first_ids is None:
                first_ids = ids
            elif not bool((ids.shape == first_ids.shape) and (ids == first_ids).all()):
                token_sets_equal = False
        want = int(ctx.expected.rows.numel())
        step.data = {
            "rows_per_call": rows,
            "expected_rows": want,
            "per_expert_per_call": per_expert,
        }
        problems = []
        if len(set(rows)) > 1:
            problems.append(
                f"dispatch returned {rows[0]} rows first and {rows[1:]} on replay: the same "
                "routing gives different shapes (activation-checkpoint recompute would fail)"
            )
        elif rows[0] != want:
            problems.append(f"every call returned {rows[0]} rows, the routing needs {want}")
        if any(p != per_expert[0] for p in per_expert[1:]):
            problems.append("per-expert counts change between identical dispatches")
        elif per_expert[0] != ctx.expected.per_expert:
            problems.append("per-expert counts differ from the routing's on every call")
        if not token_sets_equal and not problems:
            problems.append("identical dispatches deliver different sets of tokens")
        if problems:
            raise StepFailed(
                Status.FAIL,
                "; ".join(problems),
                "dispatch is not deterministic for fixed routing; disable activation "
                "checkpointing around this backend's MoE layers or use another backend",
                step.data,
            )
        step.detail = f"{replays + 1} dispatches: {rows[0]} rows each, per-expert counts identical"
    return agree(rt, step, _summarize_replay)


def _summarize_replay(merged: Step, per_rank: list[Step]) -> None:
    if all("rows_per_call" in s.data for s in per_rank):
        merged.data["rows_per_call_per_rank"] = [s.data["rows_per_call"] for s in per_rank]
        if merged.status == Status.PASS:
            calls = len(per_rank[0].data["rows_per_call"])
            merged.detail = (
                f"{calls} identical dispatches on every rank; rows/rank "
                f"{[s.data['rows_per_call'][0] for s in per_rank]}"
            )


def step_bandwidth(
    rt: Runtime, backend: EPBackend, ctx: CheckContext, args: argparse.Namespace
) -> Step:
    """GB/s of dispatch and combine (received bytes / median time) and of a device copy."""
    import _ep_reference as ref
    import torch

    with timed_step("bandwidth") as step:
        inp = ctx.inputs
        d = backend.dispatch(inp.x, inp.topk_idx, inp.topk_weights)
        scale = ref.row_scale(
            d.recv_topk_idx, d.recv_topk_weights, ctx.scales, rt.env.rank, ctx.local
        )
        y = (d.recv_x.float() * scale[:, None]).to(d.recv_x.dtype)
        rows = int(d.recv_x.shape[0])
        nbytes = rows * ctx.shape.hidden * d.recv_x.element_size()
        t_dispatch = _bench(
            rt, lambda: backend.dispatch(inp.x, inp.topk_idx, inp.topk_weights), args
        )
        t_combine = _bench(rt, lambda: backend.combine(y, d.handle), args)
        src = torch.empty(
            max(nbytes // d.recv_x.element_size(), 1), dtype=d.recv_x.dtype, device=rt.device
        )
        dst = torch.empty_like(src)
        t_copy = _bench(rt, lambda: dst.copy_(src), args, collective=False)
        copy_bytes = src.numel() * src.element_size()
        step.data = {
            "bytes": nbytes,
            "dispatch_seconds": t_dispatch,
            "combine_seconds": t_combine,
            "copy_seconds": t_copy,
            "dispatch_gbs": nbytes / t_dispatch / 1e9 if t_dispatch > 0 else 0.0,
            "combine_gbs": nbytes / t_combine / 1e9 if t_combine > 0 else 0.0,
            "copy_gbs": copy_bytes / t_copy / 1e9 if t_copy > 0 else 0.0,
            "timer": "cuda events" if rt.use_gpu else "perf_counter",
        }
        data = step.data
        data["dispatch_vs_copy"] = (
            data["dispatch_gbs"] / data["copy_gbs"] if data["copy_gbs"] else None
        )
        data["combine_vs_copy"] = (
            data["combine_gbs"] / data["copy_gbs"] if data["copy_gbs"] else None
        )
        slow = [
            f"{op} {data[op + '_gbs']:.3g} GB/s"
            for op in ("dispatch", "combine")
            if data[op + "_gbs"] < args.min_gbs
        ]
        if slow:
            raise StepFailed(
                Status.FAIL,
                f"{', '.join(slow)} below --min-gbs {args.min_gbs:g}",
                "check NVLink topology (nvidia-smi topo -m), SM/QP settings and that no other "
                "job shares the GPUs",
                data,
            )
        step.detail = (
            f"dispatch {data['dispatch_gbs']:.3g} GB/s, combine {data['combine_gbs']:.3g} GB/s, "
            f"copy {data['copy_gbs']:.3g} GB/s"
        )
    return agree(rt, step, _summarize_bandwidth)


def _summarize_bandwidth(merged: Step, per_rank: list[Step]) -> None:
    datas = [s.data for s in per_rank]
    if not all("dispatch_gbs" in d for d in datas):
        return
    summary: dict[str, Any] = {}
    for key in ("dispatch_gbs", "combine_gbs", "copy_gbs"):
        values = [d[key] for d in datas]
        summary[key] = {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}
    copy = summary["copy_gbs"]["mean"]
    summary["dispatch_vs_copy"] = summary["dispatch_gbs"]["mean"] / copy if copy else None
    summary["combine_vs_copy"] = summary["combine_gbs"]["mean"] / copy if copy else None
    merged.data.update(summary)
    if merged.status == Status.PASS:
        ratio = summary["dispatch_vs_copy"]
        merged.detail = (
            f"dispatch {summary['dispatch_gbs']['mean']:.3g} GB/s, combine "
            f"{summary['combine_gbs']['mean']:.3g} GB/s (mean of ranks); device copy "
            f"{copy:.3g} GB/s"
        )
        if ratio is not None:
            merged.detail += f"; dispatch/copy {ratio:.2g}"


def _bench(
    rt: Runtime, fn: Callable[[], Any], args: argparse.Namespace, collective: bool = True
) -> float:
    """Median seconds of ``fn`` after warm-up: CUDA events on GPU, perf_counter on CPU."""
    import torch
    import torch.distributed as dist

    for _ in range(args.warmup):
        fn()
    _sync(rt)
    if collective:
        dist.barrier(group=rt.ep_group)
    times: list[float] = []
    for _ in range(args.iters):
        if rt.use_gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _sync(rt: Runtime) -> None:
    if rt.use_gpu:
        import torch

        torch.cuda.synchronize(rt.device)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def _autograd_functions() -> tuple[Any, Any]:
    """Dispatch and combine as autograd functions, built on the backend's own backward hooks."""
    import torch

    class DispatchFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, backend, topk_idx, topk_weights, box):  # type: ignore[override]
            d = backend.dispatch(x, topk_idx, topk_weights)
            box.append(d)
            ctx.backend, ctx.handle = backend, d.handle
            return d.recv_x

        @staticmethod
        def backward(ctx, grad):  # type: ignore[override]
            return (
                ctx.backend.dispatch_backward(grad.contiguous(), ctx.handle),
                None,
                None,
                None,
                None,
            )

    class CombineFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y, backend, handle):  # type: ignore[override]
            ctx.backend, ctx.handle = backend, handle
            return backend.combine(y, handle)

        @staticmethod
        def backward(ctx, grad):  # type: ignore[override]
            return ctx.backend.combine_backward(grad.contiguous(), ctx.handle), None, None

    return DispatchFn, CombineFn


class _Lazy:
    """Resolves the autograd classes on first use, so importing this module stays torch-free."""

    def __init__(self, index: int) -> None:
        self.index = index

    def apply(self, *args: Any) -> Any:
        return _autograd_functions()[self.index].apply(*args)


_DispatchFn = _Lazy(0)
_CombineFn = _Lazy(1)


# ------------------------------------------------------------------------------------------
# Orchestration
# ------------------------------------------------------------------------------------------


def resolve_shape(args: argparse.Namespace, on_gpu: bool, world: int) -> dict[str, int]:
    defaults = GPU_DEFAULTS if on_gpu else CPU_DEFAULTS
    sizes = {
        k: getattr(args, k) if getattr(args, k) is not None else v for k, v in defaults.items()
    }
    validate_shape(sizes["tokens"], sizes["hidden"], sizes["experts"], sizes["topk"], world)
    return sizes


def not_run(name: str, gate: Step) -> Step:
    return Step(name, Status.NOT_RUN, detail=f"not run: {gate.name} ended '{gate.status.value}'")


def header_lines(sel: Selection, env: RankEnv, meta: dict[str, Any]) -> list[str]:
    lines = [f"backend {sel.name} ({sel.how})"]
    where = f"world {env.world}"
    if meta.get("device"):
        where += f", device {meta['device']}, dtype {meta.get('dtype')}"
    lines.append(where)
    if meta.get("shape"):
        s = meta["shape"]
        lines.append(
            f"tokens/rank {s['tokens']}, hidden {s['hidden']}, experts {s['experts']} "
            f"({s['experts'] // env.world}/rank), top-{s['topk']}, seed {meta.get('seed')}"
        )
    return lines


def finish(
    args: argparse.Namespace,
    env: RankEnv,
    sel: Selection,
    steps: list[Step],
    meta: dict[str, Any],
    code: int,
) -> int:
    """Print the table and write the JSON report on rank 0; return ``code``."""
    if env.rank != 0:
        return code
    versions = {
        "python": sys.version.split()[0],
        "torch": (_facts.dist_version("torch") or (None, None))[1],
    }
    if sel.installed is not None:
        versions["backend"] = sel.installed.to_json()
    report = build_report(
        "check_ep",
        steps,
        code,
        backend=sel.name,
        backend_selection=sel.how,
        world_size=env.world,
        require=bool(args.require),
        versions=versions,
        numbers=_numbers(steps),
        **meta,
    )
    print(render_table("check_ep", header_lines(sel, env, meta), steps, code), flush=True)
    if args.json:
        write_json_atomic(args.json, report)
    return code


def _numbers(steps: list[Step]) -> dict[str, Any]:
    """The headline numbers of the run, lifted out of the steps for easy reading."""
    by_name = {s.name: s.data for s in steps}
    numbers: dict[str, Any] = {}
    dc = by_name.get("dispatch_combine", {})
    for key in (
        "received_per_rank",
        "expected_per_rank",
        "received_per_expert",
        "max_rel_diff",
        "tolerance",
    ):
        if key in dc:
            numbers[key] = dc[key]
    if "received_per_rank" not in numbers and "received" in dc:
        numbers["received_per_rank"] = [dc["received"]]
        numbers["expected_per_rank"] = [dc["expected"]]
        numbers["received_per_expert"] = dc["per_expert"]
        numbers["max_rel_diff"] = dc["rel_diff"]
        numbers["tolerance"] = dc["tolerance"]
    bw = by_name.get("backward", {})
    if "max_grad_rel_diff" in bw or "grad_rel_diff" in bw:
        numbers["max_grad_rel_diff"] = bw.get("max_grad_rel_diff", bw.get("grad_rel_diff"))
    rp = by_name.get("replay", {})
    if "rows_per_call_per_rank" in rp or "rows_per_call" in rp:
        numbers["replay_rows_per_call"] = rp.get(
            "rows_per_call_per_rank", [rp.get("rows_per_call")]
        )
    band = by_name.get("bandwidth", {})
    for key in ("dispatch_gbs", "combine_gbs", "copy_gbs", "dispatch_vs_copy", "combine_vs_copy"):
        if key in band:
            value = band[key]
            numbers[key] = value["mean"] if isinstance(value, dict) else value
    return numbers


def run(args: argparse.Namespace, argv: list[str]) -> int:
    env = RankEnv.from_environ()
    validate_static(args, env.world)
    if args.nproc_per_node:
        if env.launched:
            raise UsageError("--nproc-per-node cannot be used under torchrun; pass one of them")
        return launch_local(args.nproc_per_node, argv, args.timeout)

    sel = select_backend(args)
    if sel.verdict is not None:
        steps = [sel.verdict] + [not_run(n, sel.verdict) for n in STEP_NAMES[1:]]
        return finish(args, env, sel, steps, {}, exit_code_of(steps, args.require))

    # The backend runs in a supervised child: a segfault in its native code becomes a
    # report (exit 3) instead of a silent death.
    code, crash = _supervise.run_supervised(lambda: _worker(args, env, sel))
    if crash is not None:
        return report_crash(args, env, sel, crash)
    return code


def _worker(args: argparse.Namespace, env: RankEnv, sel: Selection) -> int:
    """The supervised child: bad usage is still one line and exit 2 here."""
    try:
        return run_worker(args, env, sel)
    except UsageError as exc:
        if env.rank == 0:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


def report_crash(
    args: argparse.Namespace, env: RankEnv, sel: Selection, crash: _supervise.Crash
) -> int:
    """The child died by a signal: report the step it was in as ERROR (exit 3)."""
    state = crash.progress
    done = [Step.from_json(obj) for obj in state.get("steps", [])]
    current = state.get("current") or STEP_NAMES[min(len(done), len(STEP_NAMES) - 1)]
    where = f" at {crash.where}" if crash.where else ""
    step = Step(
        current,
        Status.ERROR,
        detail=f"rank {env.rank} died with {crash.signal_name} during {current}{where}",
        hint="the backend crashed in native code (Python stack above): run its own tests on "
        "this machine, check that it was built for this torch, CUDA and NCCL, and report it "
        "with this JSON",
    )
    index = STEP_NAMES.index(current) if current in STEP_NAMES else len(done)
    steps = [*done[:index], step, *(not_run(n, step) for n in STEP_NAMES[index + 1 :])]
    if crash.fault_log:
        print(crash.fault_log.rstrip(), file=sys.stderr)
    if env.rank != 0:
        print(f"{PROG}: {step.detail}", file=sys.stderr)
    sel.name = state.get("backend", sel.name)
    return finish(args, env, sel, steps, state.get("meta", {}), EXIT_UNUSABLE)


def run_worker(args: argparse.Namespace, env: RankEnv, sel: Selection) -> int:
    """Import torch and the backend, set up the process groups, run the steps, report."""
    _supervise.progress.update(backend=sel.name, current="import", steps=[])
    import ep_adapters
    import torch

    backend_cls = (
        ep_adapters.load_backend_class(args.backend_class)
        if args.backend_class
        else ep_adapters.BUILTIN[sel.name]
    )
    if sel.custom:
        sel.name = backend_cls.name
    backend = backend_cls()
    gpu_visible = torch.cuda.is_available() and torch.cuda.device_count() > 0
    if backend.requires_gpu:
        if args.device == "cpu":
            raise UsageError(
                f"{backend.name} runs on GPUs only; drop --device cpu or use --backend torch"
            )
        use_gpu = gpu_visible and torch.cuda.device_count() > env.local_rank
    elif args.device == "cuda":
        if not gpu_visible:
            raise UsageError("--device cuda but no GPU is visible; use --device cpu")
        use_gpu = True
    else:
        use_gpu = args.device == "auto" and gpu_visible
    on_gpu_defaults = backend.requires_gpu or use_gpu
    sizes = resolve_shape(args, on_gpu_defaults, env.world)
    dtype_name = (
        args.dtype if args.dtype != "auto" else ("bfloat16" if on_gpu_defaults else "float32")
    )
    if dtype_name not in backend.dtypes:
        raise UsageError(
            f"{backend.name} dispatches {', '.join(backend.dtypes)} only, not {dtype_name}"
        )

    rt = init_distributed(env, use_gpu, args.timeout)
    shape = ep_adapters.Shape(dtype=getattr(torch, dtype_name), device=rt.device, **sizes)
    meta = {"device": str(rt.device), "dtype": dtype_name, "shape": sizes, "seed": args.seed}
    _supervise.progress.update(backend=sel.name, meta=meta)
    steps: list[Step] = []
    try:
        steps = run_steps(rt, sel, backend, shape, args)
    finally:
        try:
            backend.destroy()
        except Exception as exc:  # a failing destroy must not hide the verdict
            print(
                f"{PROG}: rank {env.rank}: backend destroy failed: {one_line(str(exc))}",
                file=sys.stderr,
            )
    code = exit_code_of(steps, args.require)
    code = _agree_code(rt, code)
    try:
        return finish(args, env, sel, steps, meta, code)
    finally:
        import torch.distributed as dist

        dist.barrier(group=rt.ctrl_group)
        dist.destroy_process_group()


def run_steps(
    rt: Runtime, sel: Selection, backend: EPBackend, shape: Shape, args: argparse.Namespace
) -> list[Step]:
    steps: list[Step] = []

    def begin(name: str) -> None:
        """Leave a breadcrumb: if the backend kills the process, the supervisor says where."""
        _supervise.progress.update(current=name, steps=[s.to_json() for s in steps])

    def gate_failed(step: Step) -> bool:
        steps.append(step)
        if step.status != Status.PASS:
            steps.extend(not_run(n, step) for n in STEP_NAMES[len(steps) :])
            return True
        return False

    begin("import")
    if gate_failed(step_import(rt, sel, backend)):
        return steps
    begin("prerequisites")
    if gate_failed(step_prerequisites(rt, backend)):
        return steps
    begin("buffer")
    if gate_failed(step_buffer(rt, backend, shape)):
        return steps
    begin("dispatch_combine")
    with timed_step("dispatch_combine") as prep:
        ctx = prepare_checks(rt, shape, args)
    if prep.status != Status.PASS:
        prep.detail = "preparing the reference failed: " + prep.detail
        gate_failed(agree(rt, prep))
        return steps
    checks: list[tuple[str, Callable[[], Step]]] = [
        ("dispatch_combine", lambda: step_dispatch_combine(rt, backend, ctx)),
        ("backward", lambda: step_backward(rt, backend, ctx, args.seed)),
        ("replay", lambda: step_replay(rt, backend, ctx, args.replays)),
        ("bandwidth", lambda: step_bandwidth(rt, backend, ctx, args)),
    ]
    for name, check in checks:
        begin(name)
        step = check()
        steps.append(step)
        if step.status == Status.ERROR:
            # The backend raised: its state (and the group's) is unknown, stop here.
            steps.extend(not_run(n, step) for n in STEP_NAMES[len(steps) :])
            break
    return steps


def _agree_code(rt: Runtime, code: int) -> int:
    """All ranks leave with the same, most severe, exit code."""
    import torch
    import torch.distributed as dist

    severity = torch.tensor([_CODE_SEVERITY.get(code, 3)], dtype=torch.int64)
    dist.all_reduce(severity, op=dist.ReduceOp.MAX, group=rt.ctrl_group)
    for c, sev in _CODE_SEVERITY.items():
        if sev == int(severity.item()):
            return c
    return code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def _main() -> int:
        return run(parse_args(argv), argv)

    try:
        return _main()
    except UsageError as exc:
        if os.environ.get("RANK", "0") == "0":
            print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
