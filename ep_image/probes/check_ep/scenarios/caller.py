"""What a training framework does with its own tensors around each backend call, for the
``views`` scenario: it hands over views, and it reuses its memory once a call returns.

Why this module exists: a framework passes a backend slices of wider activations and transposed
views (not fresh contiguous tensors), and reuses its buffers as soon as a call returns: its
inputs are overwritten by the next layer, and the outputs it got back are its own to write
over. A backend that reads a view as if it were contiguous, writes into its caller's inputs,
returns or keeps a view of them, or reads back later from what it returned, is right for fresh
tensors only. Each call through :class:`Caller` checks all four.

A backend may instead refuse views (DeepEP asserts ``x.is_contiguous()``): a precondition, not
a fault. When a call raises on every rank, the caller finds out which views it refuses (the
same call again with contiguous inputs, then with one tensor at a time handed as a view) and
goes on handing views only of the tensors it takes, so those are still checked.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import torch

from ep_image.probes.check_ep.reference import same_values
from ep_image.probes.check_ep.scenarios.verdict import VIEW_KINDS, Refusal, label

#: What the caller writes over its memory with: far from every value the probe sends.
JUNK_FLOAT = 7.0
JUNK_INT = -7


def _junk(t: torch.Tensor) -> float | int:
    return JUNK_FLOAT if t.is_floating_point() else JUNK_INT


class BackendRaised(Exception):
    """The backend raised inside a scenario (or, in ``views``, called ``sys.exit``): its state
    (and the group's) is unknown now. ``how`` says what it did, for a precondition."""

    def __init__(self, where: str, exc: BaseException) -> None:
        if isinstance(exc, SystemExit):
            self.how = f"calls sys.exit({exc.code!r})"
            super().__init__(f"{where} called sys.exit({exc.code!r})")
        else:
            self.how = f"raises {type(exc).__name__}: {' '.join(str(exc).split())}"
            super().__init__(f"{where} {self.how.replace('raises', 'raised', 1)}")


def as_view(t: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``t``'s values in a non-contiguous view, and the memory behind it: a column slice of a
    wider tensor, or the transpose of a transposed copy (``kind``, one of VIEW_KINDS)."""
    if kind == "transpose":
        base = t.t().contiguous()
        return base.t(), base
    base = torch.full((t.shape[0], t.shape[1] + 3), _junk(t), dtype=t.dtype, device=t.device)
    view = base[:, : t.shape[1]]
    view.copy_(t)
    return view, base


def _viewable(arg: Any) -> bool:
    return isinstance(arg, torch.Tensor) and arg.dim() == 2


def _outputs(out: Any) -> list[torch.Tensor]:
    """The tensors a backend call returned (a Dispatched's rows, routing and weights)."""
    if isinstance(out, torch.Tensor):
        return [out]
    found = [getattr(out, n, None) for n in ("recv_x", "recv_topk_idx", "recv_topk_weights")]
    return [t for t in found if isinstance(t, torch.Tensor)]


def _names(fn: Callable[..., Any], count: int) -> tuple[str, list[str]]:
    """The backend call ``fn`` is (``dispatch``) and its arguments' names (``x``, ...)."""
    call = getattr(fn, "__name__", "call")
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        params = []
    params += [f"argument {i}" for i in range(len(params), count)]
    return call, params[:count]


#: Which views one call hands over: argument index -> a kind of VIEW_KINDS, or None (a
#: contiguous copy).
Plan = dict[int, str | None]


@dataclasses.dataclass
class Caller:
    """Hands a backend views of its inputs and reuses its memory after each call; the problems
    found go to ``check(where, ...)`` like every other comparison of the scenario, and the views
    it refuses to ``refusals``."""

    call: Callable[..., Any]  # Run.call: the backend call, with its breadcrumb
    check: Callable[..., None]  # Run.check: record a comparison's problems
    #: Whether every rank's backend raised at this same point too (so all of them narrow the
    #: refusal down together, making the same calls; else the raise is an error).
    everyone_raised: Callable[[], bool]
    scenario: str = "views"
    calls: int = 0
    refused: set[tuple[str, str, str]] = dataclasses.field(default_factory=set)
    refusals: list[Refusal] = dataclasses.field(default_factory=list)

    def __call__(self, where: str, fn: Callable[..., Any], *args: Any) -> Any:
        self.calls += 1
        call, params = _names(fn, len(args))
        try:
            return self._checked(where, fn, args, self._plan(call, params, args))
        except BackendRaised as exc:
            if not any(self._plan(call, params, args).values()) or not self.everyone_raised():
                raise  # it refuses contiguous inputs too, or not on every rank: an error
            first = exc
        if not self._narrow(where, fn, args, call, params, first):
            raise first
        return self._checked(where, fn, args, self._plan(call, params, args))

    def _plan(self, call: str, params: list[str], args: tuple[Any, ...]) -> Plan:
        """The views this call hands over: alternating kinds, never one it refused."""
        plan: Plan = {}
        for i, arg in enumerate(args):
            if not _viewable(arg):
                continue
            kinds = VIEW_KINDS[(self.calls + i) % 2 :] + VIEW_KINDS[: (self.calls + i) % 2]
            plan[i] = next((k for k in kinds if (call, params[i], k) not in self.refused), None)
        return plan

    def _narrow(
        self,
        where: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        call: str,
        params: list[str],
        first: BackendRaised,
    ) -> bool:
        """Which views ``call`` refuses: the same call with contiguous inputs (raising again,
        it is an error), then with each tensor handed alone as each kind of view. False when it
        took every one alone (it refuses them only together: not a precondition to name)."""
        contiguous: Plan = dict.fromkeys(self._plan(call, params, args))
        try:
            self._hand(f"{where} (contiguous)", fn, args, params, contiguous)
        except BackendRaised:
            raise first from None
        found: dict[str, list[str]] = {}
        for i in contiguous:
            for kind in VIEW_KINDS:
                if (call, params[i], kind) in self.refused:
                    continue
                alone = {**contiguous, i: kind}
                try:
                    self._hand(f"{where} ({label(params[i], kind)} alone)", fn, args, params, alone)
                except BackendRaised as exc:
                    if not self.everyone_raised():
                        raise
                    self.refused.add((call, params[i], kind))
                    found.setdefault(exc.how, []).append(label(params[i], kind))
        for how, tensors in found.items():
            self.refusals.append(Refusal(self.scenario, call, tensors, how))
        return bool(found)

    def _hand(
        self,
        where: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        params: list[str],
        plan: Plan,
    ) -> tuple[Any, list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
        """One call with ``plan``'s views (a contiguous copy of every other 2-D tensor): what it
        returned, the caller's memory behind what it handed, and what it handed with the values
        it sent."""
        handed: list[Any] = []
        bases: list[torch.Tensor] = []
        sent: list[tuple[torch.Tensor, torch.Tensor]] = []
        labels: list[str] = []
        for i, arg in enumerate(args):
            if i not in plan:
                handed.append(arg)
                continue
            kind = plan[i]
            if kind is None:
                view = base = arg.clone()
            else:
                view, base = as_view(arg, kind)
                labels.append(label(params[i], kind))
            handed.append(view)
            bases.append(base)
            sent.append((view, arg.clone()))
        call = getattr(fn, "__name__", "call")
        out = self.call(where, fn, *handed, views={"call": call, "tensors": labels})
        return out, bases, sent

    def _checked(
        self, where: str, fn: Callable[..., Any], args: tuple[Any, ...], plan: Plan
    ) -> Any:
        """The scenario's call: handed ``plan``'s views, then the caller's memory reused, both
        checked."""
        _, params = _names(fn, len(args))
        out, bases, sent = self._hand(where, fn, args, params, plan)
        self.check(where, _inputs_kept, sent)
        kept = [t.clone() for t in _outputs(out)]
        for base in bases:  # the caller's next layer writes its activations over them
            base.fill_(_junk(base))
        self.check(where, _outputs_kept, _outputs(out), kept)
        return out

    @staticmethod
    def reuse(t: Any) -> None:
        """The caller writes over a tensor the backend gave it, now that it has read it."""
        if isinstance(t, torch.Tensor) and t.numel():
            t.fill_(_junk(t))


def _inputs_kept(sent: list[tuple[torch.Tensor, torch.Tensor]]) -> list[str]:
    """The views the caller handed over still hold what it sent: the backend wrote nothing into
    its caller's tensors."""
    changed = [i for i, (view, before) in enumerate(sent) if not same_values(view, before)]
    if not changed:
        return []
    return [
        f"the call wrote into its caller's input {changed} (a framework's activations and "
        "routing are its own: a backend must not change them)"
    ]


def _outputs_kept(now: list[torch.Tensor], kept: list[torch.Tensor]) -> list[str]:
    """What the call returned did not change when the caller overwrote its own inputs."""
    if all(same_values(a, b) for a, b in zip(now, kept, strict=True)):
        return []
    return [
        "what the call returned changed when its caller overwrote its own input tensors: the "
        "backend returned (or reads from) a view of its caller's memory"
    ]
