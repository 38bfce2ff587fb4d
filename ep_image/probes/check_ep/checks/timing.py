"""Timing backend calls: the median of timed calls after warm-up, each call's output checked.

Why this module exists: the bandwidth step times the backend and the reference path the same
way (same inputs prepared before each timing starts, same clock, the same median), and an
untimed call of each measures its peak memory where the measurement cannot slow the timing.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ep_image.probes import _supervise
from ep_image.probes._ranks.runtime import Runtime, sync
from ep_image.probes.check_ep.checks.call_memory import CallMemory, measure


@dataclasses.dataclass
class Timing:
    """The median seconds of the timed calls, the calls that returned wrong data (by their
    index, warm-up included), the calls made and timed, and one untimed call's memory."""

    seconds: float
    bad: list[int]
    calls: int
    timed: int
    memory: CallMemory | None = None


def bench(
    rt: Runtime,
    prepare: Callable[[int], Any],
    fn: Callable[[Any], Any],
    warmup: int,
    iters: int,
    is_wrong: Callable[[int, Any], Any] | None,
    collective: bool = True,
    memory: bool = False,
    label: str | None = None,
) -> Timing:
    """Median seconds of ``fn(prepare(i))`` after ``warmup`` calls, and the calls
    ``is_wrong(i, out)``.

    Call ``i``'s input is prepared before its timing starts, and its check is queued after its
    end event, so neither is part of the timing. With ``memory``, the last warm-up call (an
    extra untimed one when there is no warm-up) is measured by ``call_memory.measure``.
    With ``label`` (the backend's operation timed), a wrong call is also noted in the
    breadcrumb as soon as it is known without waiting on the GPU (``Progress.found_wrong``):
    should the ranks then stop meeting in a collective, the report keeps what it earned.
    """
    flags: list[Any] = []
    calls = 0
    measured: CallMemory | None = None

    def judge(i: int, out: Any) -> Any:
        """Call ``i``'s flag; an output too malformed to check is wrong (never an exception:
        this rank must go on making the calls its peers make)."""
        try:
            flag = is_wrong(i, out) if is_wrong is not None else False
        except Exception:
            flag = True
        if label is not None and _on_host(flag) and bool(flag):
            last = _supervise.progress.last_call
            said = f" (the backend's {last})" if last else ""
            _supervise.progress.found_wrong(f"{label} #{i}{said} returned wrong data")
        return flag

    def note_wrong() -> None:
        """After a sync: the first wrong call so far, if any, in the breadcrumb."""
        if label is not None:
            bad = [i for i, flag in enumerate(flags) if bool(flag)]
            if bad:
                _supervise.progress.found_wrong(f"{label} #{bad[0]} returned wrong data")

    def call(measure_it: bool = False) -> None:
        nonlocal calls, measured
        inp = prepare(calls)
        if measure_it:
            out, measured = measure(lambda: fn(inp), rt.device)
        else:
            out = fn(inp)
        flags.append(judge(calls, out))
        calls += 1

    untimed = max(warmup, 1) if memory else warmup
    for i in range(untimed):
        call(measure_it=memory and i == untimed - 1)
    sync(rt)
    note_wrong()
    if collective:
        dist.barrier(group=rt.ctrl_group)
    times: list[float] = []
    for _ in range(iters):
        inp = prepare(calls)
        if rt.use_gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(inp)
            end.record()
            flags.append(judge(calls, out))
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            out = fn(inp)
            times.append(time.perf_counter() - t0)
            flags.append(judge(calls, out))
        calls += 1
    sync(rt)
    note_wrong()
    bad = [i for i, flag in enumerate(flags) if bool(flag)]
    return Timing(statistics.median(times), bad, calls, len(times), measured)


def _on_host(flag: Any) -> bool:
    """Whether reading ``flag`` costs no wait on the GPU (a Python value or a CPU tensor)."""
    return not isinstance(flag, torch.Tensor) or flag.device.type == "cpu"
