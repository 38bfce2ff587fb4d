"""check_train's verdicts, drawn from the two trainings: did each learn, did the recompute get
its forward's rows, do the backend's steps match the fallback's, does memory stay flat, how
fast was it.

Why this module exists: each verdict names what a user can act on (the step and layer, the
number against its bound, the fix), and none needs torch: they read the phases' records.
"""

from __future__ import annotations

import itertools
import statistics
from typing import Any

from ep_image.probes._ranks.runtime import ONE_RANK_LABEL
from ep_image.probes._report import Status, Step, StepFailed, timed_step
from ep_image.probes.check_train.types import (
    FINDINGS,
    LEAK_BYTES,
    LEAK_STEPS,
    LEGAL,
    agreement_bound,
    trajectory_bound,
)

#: The loss must fall this far over the run (last step's against the first's) to count as
#: learning: the task is learnable, so a training that does not reach it is broken.
MIN_FALL = 0.1

MIXED_LAYOUTS_FIX = (
    "the backend's handle must take the rows its dispatch returned back where they came from "
    "(the combine and dispatch's backward along the recompute's handle got the recompute's "
    "rows); until it does, recompute along the forward's layout (--recompute cached) or turn "
    "off activation checkpointing around its MoE layers"
)

RECOMPUTE_FIX = (
    "turn off activation checkpointing around this backend's MoE layers, or recompute them "
    "along the forward's layout (a cached dispatch with the forward's handle: check it with "
    "--recompute cached), or pad each rank's tokens as the backend needs (HybridEP: the same "
    "count on every rank, a multiple of 4)"
)


def losses_text(losses: list[float]) -> str:
    return f"loss {losses[0]:.4g} -> {losses[-1]:.4g}"


def falls(losses: list[float]) -> bool:
    return len(losses) >= 2 and losses[-1] <= losses[0] * (1 - MIN_FALL)


def median_seconds(records: list[Any]) -> float:
    """The median step time, the first step left out (compiling, first allocations)."""
    times = [r.seconds for r in records[1:]] or [r.seconds for r in records]
    return statistics.median(times)


def phase_data(result: Any, tokens: int) -> dict[str, Any]:
    """A phase's numbers for the report."""
    steps = result.steps
    data: dict[str, Any] = {
        "routing": result.routing,
        "losses": [s.loss for s in steps],
        "grad_norms": [s.grad_norm for s in steps],
        "step_seconds": [round(s.seconds, 6) for s in steps],
        "live_bytes": [s.live_bytes for s in steps],
        "peak_bytes": [s.peak_bytes for s in steps],
    }
    if steps:
        data["median_step_seconds"] = median_seconds(steps)
        data["tokens_per_second"] = tokens / data["median_step_seconds"]
    return data


#: The fallback's verdict when it does not train: the settings', not the backend's.
DID_NOT_TRAIN = "the model did not train with these settings, the all-gather fallback neither"
#: What the steps after it say: the backend's training has no oracle to be judged against.
NOT_JUDGED = (
    "not run: the model did not train with these settings (the fallback step), so the "
    "backend's training would have nothing to be judged against"
)


def step_fallback(result: Any, tokens: int) -> Step:
    """The oracle's training. One that does not train (not finite, or its loss does not fall)
    says the settings cannot train the model, whatever the backend: the backend is then not
    judged (``data["did_not_train"]``), rather than blamed for what the fallback does too."""
    with timed_step("fallback") as step:
        step.data = phase_data(result, tokens)
        bad = [p for s in result.steps for p in s.nonfinite]
        if bad:
            step.data["did_not_train"] = True
            raise StepFailed(
                Status.FAIL,
                f"{DID_NOT_TRAIN}: it diverged ({bad[0]}); the backend is not judged",
                "not the backend's doing: the model diverges with these flags; lower --lr",
                step.data,
            )
        losses = step.data["losses"]
        if not falls(losses):
            step.data["did_not_train"] = True
            raise StepFailed(
                Status.FAIL,
                f"{DID_NOT_TRAIN}: {losses_text(losses)} over {len(losses)} steps (must fall "
                f"{MIN_FALL:.0%}); the backend is not judged",
                "not the backend's doing: change the flags until the fallback learns (more "
                "--steps or --tokens, another --lr, a smaller model)",
                step.data,
            )
        step.detail = (
            f"{len(losses)} steps: {losses_text(losses)}, median "
            f"{step.data['median_step_seconds'] * 1e3:.1f} ms/step"
        ) + routing_note(result.routing)
    return step


def routing_note(routing: dict[str, Any]) -> str:
    """What the recomputes' routers chose against their forwards, where they moved: a finding
    about this process (a framework that recomputes MoE layers must replay the forward's
    routing here), not about the exchange."""
    moved = routing.get("tokens_moved", 0)
    if not moved:
        return ""
    return (
        f"; the router's recompute chose other experts for {moved} token(s) over "
        f"{routing['recomputes']} recomputed layers (chosen scores moved by up to "
        f"{routing['score_drift']:.3g}): the forward's routing was replayed, as a framework "
        "must replay it to recompute MoE layers in this process"
    )


def step_train(result: Any, tokens: int, checkpointed: bool) -> Step:
    with timed_step("train") as step:
        step.data = phase_data(result, tokens)
        losses = step.data["losses"]
        how = "with checkpointing" if checkpointed else "without checkpointing"
        if result.mismatch:
            raise StepFailed(
                Status.FAIL,
                f"stopped after {len(losses)} clean steps {how}: {result.mismatch}",
                RECOMPUTE_FIX,
                step.data,
            )
        bad = [p for s in result.steps for p in s.nonfinite]
        if bad:
            step.data["nonfinite"] = bad
            raise StepFailed(
                Status.FAIL,
                f"{bad[0]}" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""),
                "the backend returns NaN or Inf where the fallback does not: run check_ep on "
                "this backend and report it with this JSON",
                step.data,
            )
        if not falls(losses):
            raise StepFailed(
                Status.FAIL,
                f"the backend's training does not learn: {losses_text(losses)} over "
                f"{len(losses)} steps",
                "compare with the fallback step: the backend's gradients are wrong",
                step.data,
            )
        step.detail = (
            f"{len(losses)} steps {how}: {losses_text(losses)}, every MoE output and input "
            f"gradient finite, median {step.data['median_step_seconds'] * 1e3:.1f} ms/step"
        ) + routing_note(result.routing)
    return step


def _worst(result: Any, name: str, key: str) -> tuple[float, int]:
    """The largest of one reference measure over the steps, and its step."""
    values = [(s.references[name][key], s.step) for s in result.steps if name in s.references]
    return max(values) if values else (0.0, -1)


_MEASURES = (("loss_rel", "loss"), ("grad_norm_rel", "gradient norm"), ("grad_rel", "gradient"))


def _over(result: Any, name: str, bound: float) -> list[str]:
    """Each measure of reference ``name`` past ``bound``, at its first step past it."""
    found = []
    for key, what in _MEASURES:
        for s in result.steps:
            value = s.references.get(name, {}).get(key)
            if value is not None and not value <= bound:
                found.append(f"step {s.step}: {what} differs by {value:.3g} (> {bound:.3g})")
                break
    return found


def tally(checks: list[dict[str, Any]]) -> dict[str, int]:
    """How many recomputes found each of :data:`FINDINGS`."""
    counts = dict.fromkeys(FINDINGS, 0)
    for check in checks:
        counts[check["found"]] += 1
    return counts


#: The recomputes a framework may use with a backend (``steps[recompute].data.frameworks``):
#: dispatching again with the handle recomputed alongside the rows (a reentrant recompute,
#: Megatron's); pairing the forward's handle, kept on the autograd node, with the recomputed
#: rows (torch's non-reentrant checkpoint around an ``autograd.Function`` that keeps its
#: handle in ``ctx``); a cached dispatch along the forward's handle.
FRAMEWORK_RECOMPUTES = (
    "dispatch_with_its_handle",
    "dispatch_with_forward_handle",
    "cached_dispatch",
)


def frameworks(mode: str, found: dict[str, int], right: bool) -> tuple[dict[str, str], str]:
    """Which recompute a framework can use with this backend ("yes", "no", "not run"), from
    what the recomputes found and whether the gradients with checkpointing were ``right``, and
    the sentence that says so."""
    if mode == "cached":
        cached = "yes" if right else "no"
        return (
            {
                "dispatch_with_its_handle": "not run",
                "dispatch_with_forward_handle": "not run",
                "cached_dispatch": cached,
            },
            f"a cached dispatch along the forward's handle: {cached}; a recompute that "
            "dispatches again: not run (--recompute dispatch checks it)",
        )
    illegal = [k for k in FINDINGS if k not in LEGAL and found[k]]
    moved = found["reordered"] + found["slots"]
    own = "yes" if right and not illegal else "no"
    forward = "yes" if own == "yes" and not moved else "no"
    verdict = {
        "dispatch_with_its_handle": own,
        "dispatch_with_forward_handle": forward,
        "cached_dispatch": "not run",
    }
    if forward == "yes":
        text = (
            "any recompute by dispatch: it returns its forward's rows in its forward's order "
            "(with the handle recomputed beside them, or the forward's kept on the autograd node)"
        )
    elif own == "yes":
        text = (
            "a recompute that dispatches again and uses the handle it returned (reentrant, as "
            "Megatron's); not the forward's handle kept on the autograd node (torch's "
            "non-reentrant checkpoint around it): the rows come in another order, so such a "
            "framework must recompute along the forward's layout (--recompute cached checks it)"
        )
    else:
        text = (
            "no recompute by dispatch: turn off checkpointing around the MoE layers or "
            "recompute along the forward's layout (--recompute cached checks it)"
        )
    return verdict, text


def _moved_text(found: dict[str, int], total: int) -> str:
    """How many recomputes got their forward's rows in another order or with other slots."""
    parts = []
    if found["reordered"]:
        parts.append(f"{found['reordered']} of {total} in another order")
    if found["slots"]:
        parts.append(f"{found['slots']} of {total} with top-k slots inside rows in another order")
    return " and ".join(parts)


def step_recompute(
    result: Any, layers: int, checkpointed: bool, checks: list[dict], mode: str = "dispatch"
) -> Step:
    with timed_step("recompute") as step:
        if not checkpointed:
            step.status = Status.NOT_RUN
            step.detail = "not run: --no-checkpoint"
            return step
        bound = agreement_bound(layers)
        found = tally(checks)
        step.data = {"recomputes": checks, "findings": found, "mode": mode, "bound": bound}
        moved = found["reordered"] + found["slots"]
        if result.mismatch:
            step.data["frameworks"], step.data["verdict"] = frameworks(mode, found, False)
            raise StepFailed(Status.FAIL, result.mismatch, RECOMPUTE_FIX, step.data)
        problems = _over(result, "no_checkpoint", bound)
        for key, _ in _MEASURES:
            step.data[f"max_{key}"] = _worst(result, "no_checkpoint", key)[0]
        step.data["frameworks"], step.data["verdict"] = frameworks(mode, found, not problems)
        if problems and moved:
            raise StepFailed(
                Status.FAIL,
                f"the recomputes' dispatches returned their forwards' rows "
                f"({_moved_text(found, len(checks))}), and the backward along the recompute's "
                "handle differs from the backend's own step without checkpointing at the same "
                "weights and batch: " + "; ".join(problems) + ": its handle does not follow "
                "the rows it returned (the backward mixes two layouts)",
                MIXED_LAYOUTS_FIX,
                step.data,
            )
        if problems:
            raise StepFailed(
                Status.FAIL,
                "with checkpointing the backend's step differs from its own step without it at "
                "the same weights and batch: " + "; ".join(problems),
                "the backend's backward is wrong after a layer was recomputed (its recomputed "
                "dispatch matched the forward's rows): " + RECOMPUTE_FIX,
                step.data,
            )
        exact = all(step.data[f"max_{k}"] == 0.0 for k, _ in _MEASURES)
        same = (
            "losses and gradients bit-identical"
            if exact
            else f"within {bound:.3g} (gradient {step.data['max_grad_rel']:.2g})"
        )
        if not moved:
            what = f"{len(checks)} recomputed dispatches got their forward's rows bit for bit"
        else:
            what = (
                f"{len(checks)} recomputed dispatches got their forward's rows, reordered "
                f"({_moved_text(found, len(checks))}): the backward along each recompute's "
                "handle is right"
            )
        usable = step.data["frameworks"]
        step.detail = (
            f"{what}; checkpointing on and off: {same}; recompute with its own handle: "
            f"{usable['dispatch_with_its_handle']}, with the forward's handle: "
            f"{usable['dispatch_with_forward_handle']}"
            if mode == "dispatch"
            else f"{what}; checkpointing on and off: {same}"
        )
    return step


def step_agreement(backend: Any, fallback: Any, layers: int) -> Step:
    with timed_step("agreement") as step:
        bound = agreement_bound(layers)
        step.data = {"bound": bound}
        for key, _ in _MEASURES:
            value, at = _worst(backend, "fallback", key)
            step.data[f"max_{key.replace('_rel', '')}_rel_diff"] = value
            step.data[f"max_{key.replace('_rel', '')}_step"] = at
        problems = _over(backend, "fallback", bound)
        both = min(len(backend.steps), len(fallback.steps))
        trajectory = [
            abs(b.loss - f.loss) / abs(f.loss) if f.loss else 0.0
            for b, f in zip(backend.steps[:both], fallback.steps[:both], strict=True)
        ]
        step.data["trajectory_loss_rel_diff"] = trajectory
        step.data["trajectory_bounds"] = [trajectory_bound(layers, s) for s in range(both)]
        for s, value in enumerate(trajectory):
            if not value <= trajectory_bound(layers, s):
                problems.append(
                    f"the two trainings' losses at step {s} differ by {value:.3g} (> "
                    f"{trajectory_bound(layers, s):.3g})"
                )
                break
        if not backend.steps:
            step.status = Status.NOT_RUN
            step.detail = "not run: the backend's training took no step"
            return step
        if problems:
            raise StepFailed(
                Status.FAIL,
                "the backend's training differs from the all-gather fallback's: "
                + "; ".join(problems),
                "the backend routes, reduces or differentiates tokens wrongly in training: run "
                "check_ep on it and report it with this JSON",
                step.data,
            )
        exact = all(step.data[f"max_{k.replace('_rel', '')}_rel_diff"] == 0.0 for k, _ in _MEASURES)
        step.detail = (
            "at every step's weights and batch, loss, gradient norm and gradient "
            + (
                "equal the fallback's bit for bit"
                if exact
                else f"within {bound:.3g} of the fallback's"
            )
            + f" (max: loss {step.data['max_loss_rel_diff']:.2g}, gradient "
            f"{step.data['max_grad_rel_diff']:.2g}); the two trainings' losses within "
            f"{trajectory_bound(layers, both - 1):.3g} at step {both - 1} (max "
            f"{max(trajectory):.2g})"
        )
    return step


def leak(live: list[int | None]) -> tuple[int, int] | None:
    """``(first step, bytes per step)`` when the live tensors grew by ``LEAK_BYTES`` or more
    at each of the last ``LEAK_STEPS`` steps (after the first, whose optimizer state is new);
    None where they did not, or were not measured."""
    if len(live) < LEAK_STEPS + 2 or any(b is None for b in live):
        return None
    tail = live[-(LEAK_STEPS + 1) :]
    growth = [b - a for a, b in itertools.pairwise(tail)]  # type: ignore[operator]
    if all(g >= LEAK_BYTES for g in growth):
        return len(live) - LEAK_STEPS - 1, sum(growth) // len(growth)
    return None


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def step_memory(backend: Any, fallback: Any) -> Step:
    """The live tensors after every step must not grow step after step; peaks side by side
    where they can be read."""
    with timed_step("memory") as step:
        live = [s.live_bytes for s in backend.steps]
        peaks = [s.peak_bytes for s in backend.steps if s.peak_bytes is not None]
        fpeaks = [s.peak_bytes for s in fallback.steps if s.peak_bytes is not None]
        step.data = {
            "live_bytes_per_step": live,
            "backend_peak_bytes": max(peaks) if peaks else None,
            "fallback_peak_bytes": max(fpeaks) if fpeaks else None,
            "leak_bytes_per_step": LEAK_BYTES,
            "leak_steps": LEAK_STEPS,
        }
        found = leak(live)
        if found is not None:
            since, per_step = found
            raise StepFailed(
                Status.FAIL,
                f"the live tensors after each step grow every step from step {since} on, by "
                f"{per_step / 1024:.1f} KiB a step ({_mib(live[0])} after step 0, "
                f"{_mib(live[-1])} after step {len(live) - 1}): training would run out of "
                "memory",
                "the backend keeps a reference to every step's tensors (handles, buffers): "
                "report it with this JSON",
                step.data,
            )
        if not live:
            step.detail = "no step of the backend's training to measure"
            return step
        if peaks and fpeaks:
            peak, fpeak = max(peaks), max(fpeaks)
            text = f"peak {_mib(peak)} against the fallback's {_mib(fpeak)} ({peak / fpeak:.2f}x)"
        else:
            text = "peak not measured on the CPU (torch's CPU allocator keeps none)"
        step.detail = f"{_mib(live[-1])} of live tensors after every step, not growing; {text}"
    return step


def step_speed(backend: Any, fallback: Any, tokens: int, label: str, reference: bool) -> Step:
    """The backend's step time against the fallback's, measured alike (``loop.time_alike``):
    the medians of each one's timed steps and the median of the pairs' ratios."""
    with timed_step("speed") as step:
        step.status = Status.INFO
        timing = backend.timing
        trajectories = {
            name: median_seconds(result.steps)
            for name, result in (("backend", backend), ("fallback", fallback))
            if result.steps
        }
        step.data = {"trajectory_median_step_seconds": trajectories, "label": label}
        if not timing or not timing["backend_seconds"]:
            step.detail = "not timed: the backend's training ended before its last step"
            return step
        b = statistics.median(timing["backend_seconds"])
        f = statistics.median(timing["fallback_seconds"])
        ratios = [
            fs / bs
            for bs, fs in zip(timing["backend_seconds"], timing["fallback_seconds"], strict=True)
            if bs
        ]
        speedup = statistics.median(ratios) if ratios else 0.0
        step.data.update(
            {
                "backend_step_seconds": b,
                "fallback_step_seconds": f,
                "backend_tokens_per_second": tokens / b if b else None,
                "fallback_tokens_per_second": tokens / f if f else None,
                "speedup": speedup,
                "protocol": timing,
            }
        )
        text = (
            f"backend {b * 1e3:.1f} ms/step ({tokens / b:,.0f} tokens/s), all-gather fallback "
            f"{f * 1e3:.1f} ms/step ({tokens / f:,.0f} tokens/s): {speedup:.2f}x over "
            f"{timing['pairs']} pairs of steps taken in turn"
        )
        if label:
            text += f" ({label})"
        if reference:
            text += "; the torch reference is the all-gather exchange itself"
        elif label == ONE_RANK_LABEL:
            # One H100: DeepEP v2 0.93x, NCCL EP 0.89x at 1 rank; 2 ranks sharing it: v1 1.03x.
            text += "; on one rank the fallback's all-gather moves nothing: no speedup to expect"
        elif speedup <= 1.0:
            slower = f"{1 / speedup:.1f}x slower than" if speedup < 1.0 else "as fast as"
            text += (
                f"; warning: the backend is {slower} the fallback: a slow path (a fallback "
                "inside the backend, a missing capability)? On shared GPUs or CPUs this can be "
                "expected"
            )
            step.hint = "compare check_ep's bandwidth step and the backend's own test"
        step.detail = text
    return step
