"""A checkpointed layer's recompute held against its forward: what its dispatch returned, in a
few hashes, and what a difference means.

Why this module exists: a backend may return its rows in any order (the adapters' contract), so
a recompute's dispatch may legally return its forward's rows in another order, or the same rows
with their top-k slots in another order; it must not return other rows, counts, experts or
weights. Training cannot tell these apart (a wrong recompute trains on, with wrong gradients,
or stops at torch's ``CheckpointError``); the fingerprint names which one happened, without a
copy of the rows (memory is what checkpointing saves) and without a host sync in the forward.
The gradients against the references judge a legal one (``verdicts``); an illegal one ends the
training on every rank with its name.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist

from ep_image.probes.check_train.types import FINDING_TEXT, FINDINGS, LEGAL

#: The fingerprint's hashes, in order. Each row's payload hash ``p`` is combined with its
#: routing: raw (slot by slot), canonical (its (expert, weight) slots sorted) or its experts
#: alone (sorted, no weights); the sums over rows do not depend on the rows' order, the
#: ``ordered_*`` ones do.
HASHES = ("payload", "experts", "routing", "raw", "ordered_routing", "ordered")

#: Columns hashed at a time: bounds the int64 temporaries to rows x this many.
_CHUNK = 128
_MASK32 = (1 << 32) - 1


def _signed(value: int) -> int:
    """A 64-bit constant as torch's int64 holds it."""
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _shr(h: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical right shift of int64 (torch's ``>>`` keeps the sign)."""
    return (h >> bits) & ((1 << (64 - bits)) - 1)


def mix(h: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer, elementwise on int64 (wrapping): a sum of mixed values no longer
    depends on the values column by column, as a sum of the raw ones would."""
    h = h + _GOLDEN
    h = (h ^ _shr(h, 30)) * _MIX1
    h = (h ^ _shr(h, 27)) * _MIX2
    return h ^ _shr(h, 31)


def _weights(n: int, device: torch.device, salt: int) -> torch.Tensor:
    """``n`` fixed odd int64 multipliers, made on the device (no copy from the host)."""
    return mix(torch.arange(n, dtype=torch.int64, device=device) + (salt << 40)) | 1


def _rows_of(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached as [rows, columns] (``reshape(rows, -1)`` fails on 0 rows)."""
    return t.detach().reshape(t.shape[0], math.prod(t.shape[1:]))


def _as_int64(t: torch.Tensor) -> torch.Tensor:
    """``t`` as [rows, columns] of int64 holding each element's bits (any dtype, 0 rows too)."""
    flat = _rows_of(t).contiguous()
    view = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    return flat.view(view).to(torch.int64)


def row_hash(t: torch.Tensor, salt: int) -> torch.Tensor:
    """One int64 per row of ``t``: its bits column by column, each column weighted, summed."""
    flat = _rows_of(t)
    rows, columns = flat.shape
    weights = _weights(columns, t.device, salt)
    out = torch.zeros(rows, dtype=torch.int64, device=t.device)
    for start in range(0, columns, _CHUNK):
        part = _as_int64(flat[:, start : start + _CHUNK])
        out += (part * weights[start : start + _CHUNK]).sum(dim=1)
    return out


@dataclasses.dataclass
class Fingerprint:
    """What a dispatch returned: its row count and counts per expert (the host has them), and
    the :data:`HASHES` of every row's bits, routing and weights, on the device until the step
    is over (no host sync in the forward; no copy of the rows)."""

    rows: int
    per_expert: list[int]
    hashes: torch.Tensor  # int64 [len(HASHES)]

    @classmethod
    def of(
        cls, recv_x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, per_expert: Any
    ) -> Fingerprint:
        rows = int(recv_x.shape[0])
        device = recv_x.device
        payload = mix(row_hash(recv_x, 1))
        experts = _rows_of(idx).to(torch.int64)
        # A slot of another rank's expert (-1) carries no weight this rank uses, and a backend
        # may leave it unset: only the weights of this rank's experts count.
        bits = torch.where(experts >= 0, _as_int64(_rows_of(w).float()) & _MASK32, 0)
        # Each slot as one key, its expert above its weight's bits: sorting the keys puts a
        # row's slots in one order whatever order the backend gave them.
        slots = experts * (1 << 32) + bits
        canonical = torch.sort(slots, dim=1).values
        by_experts = torch.sort(experts, dim=1).values

        def with_payload(t: torch.Tensor, salt: int) -> torch.Tensor:
            return mix(payload * _weights(1, device, salt) + row_hash(t, salt))

        routed = with_payload(canonical, 3)
        raw = with_payload(slots, 4)
        position = _weights(rows, device, 5)
        hashes = torch.stack(
            [
                payload.sum(),
                with_payload(by_experts, 2).sum(),
                routed.sum(),
                raw.sum(),
                mix(routed + position).sum(),
                mix(raw + position).sum(),
            ]
        )
        return cls(rows, [int(c) for c in per_expert], hashes)

    def shape_finding(self, was: Fingerprint) -> str:
        """What the host can tell at once: other rows or counts (else "same", for now)."""
        if self.rows != was.rows:
            return "rows"
        if self.per_expert != was.per_expert:
            return "counts"
        return "same"


def finding_of(equal: dict[str, bool]) -> tuple[str, bool]:
    """The finding from which of :data:`HASHES` agree (rows and counts being equal), and
    whether the rows' order changed too (for a finding about the slots)."""
    if not equal["payload"]:
        return "token_rows", False
    if not equal["experts"]:
        return "experts", False
    if not equal["routing"]:
        return "weights", False
    reordered = not equal["ordered_routing"]
    if not equal["raw"]:
        return "slots", reordered
    if not equal["ordered"]:
        return "reordered", True
    return "same", False


def describe(kind: str, was: int, found: int, reordered: bool = False) -> str:
    text = FINDING_TEXT[kind].format(was=was, found=found)
    if kind == "slots" and reordered:
        text += ", the rows in another order too"
    return text


class RecomputeMismatch(Exception):
    """A layer's recompute got other rows from dispatch than its forward did; raised on every
    rank at once (the ranks agree on it first), so no rank is left in a collective."""


@dataclasses.dataclass
class _Pending:
    step: int
    layer: int
    was: Fingerprint
    found: Fingerprint


@dataclasses.dataclass
class RecomputeLedger:
    """Each layer's first dispatch of a checked pass, to hold its recompute against. A pass is
    one forward and backward; a second dispatch of a layer in the same pass is its recompute.

    Rows and counts are compared at the recompute (the host knows them; other rows would
    otherwise stop the backward in torch's ``CheckpointError`` on some ranks only), the hashes
    once the step is over (:meth:`settle`: one host sync, outside the timed step)."""

    ctrl_group: Any  # gloo: the ranks agree on a mismatch before any rank raises
    mode: str = "dispatch"  # dispatch | cached: what the recompute asks of the backend
    step: int = 0
    checking: bool = False  # this pass is checkpointed and checked: record and compare
    records: dict[int, Fingerprint] = dataclasses.field(default_factory=dict)
    pending: list[_Pending] = dataclasses.field(default_factory=list)
    #: What every recompute found, in order: {"step", "layer", "rows", "found", "how",
    #: "ranks"} (``found``: the worst of :data:`FINDINGS` over the ranks; ``ranks``: each
    #: rank's).
    checks: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def begin(self, step: int, checking: bool) -> None:
        self.step = step
        self.checking = checking
        self.records.clear()
        self.pending.clear()

    def record(self, layer: int, fingerprint: Fingerprint) -> None:
        self.records[layer] = fingerprint

    def recompare(self, layer: int, found: Fingerprint) -> None:
        """Hold a recompute's dispatch against its forward's: other rows or counts raise
        :class:`RecomputeMismatch` on every rank now; the hashes wait for :meth:`settle`."""
        was = self.records[layer]
        kind = found.shape_finding(was)
        verdicts = self._agree(FINDINGS.index(kind), was.rows, found.rows)
        worst = max(v[0] for v in verdicts)
        if worst:
            self._append(layer, was.rows, found.rows, verdicts)
            self._raise(layer, verdicts)
        self.pending.append(_Pending(self.step, layer, was, found))

    def settle(self) -> None:
        """After the step's backward: compare every recompute's hashes (one host sync), agree
        over the ranks, record what each found, and raise :class:`RecomputeMismatch` on every
        rank at the first that found other rows, experts or weights."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        same = torch.stack([p.found.hashes == p.was.hashes for p in pending]).tolist()
        for p, equal in zip(pending, same, strict=True):
            kind, reordered = finding_of(dict(zip(HASHES, equal, strict=True)))
            code = FINDINGS.index(kind) + (len(FINDINGS) if reordered else 0)
            verdicts = self._agree(code, p.was.rows, p.found.rows)
            self._append(p.layer, p.was.rows, p.found.rows, verdicts, p.step)
            if max(v[0] % len(FINDINGS) for v in verdicts) >= len(LEGAL):
                self._raise(p.layer, verdicts, p.step)

    def _agree(self, code: int, was: int, found: int) -> list[tuple[int, int, int]]:
        """Every rank's (finding code, forward rows, recompute rows), in rank order."""
        mine = torch.tensor([code, was, found], dtype=torch.int64)
        world = dist.get_world_size(self.ctrl_group)
        gathered = [torch.zeros(3, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(gathered, mine, group=self.ctrl_group)
        return [(int(c), int(w), int(f)) for c, w, f in (g.tolist() for g in gathered)]

    def _append(
        self,
        layer: int,
        was: int,
        found: int,
        verdicts: list[tuple[int, int, int]],
        step: int | None = None,
    ) -> None:
        n = len(FINDINGS)
        kinds = [FINDINGS[c % n] for c, _, _ in verdicts]
        worst = max(range(len(verdicts)), key=lambda r: verdicts[r][0] % n)
        code, w, f = verdicts[worst]
        self.checks.append(
            {
                "step": self.step if step is None else step,
                "layer": layer,
                "rows": [was, found],
                "found": kinds[worst],
                "how": describe(kinds[worst], w, f, code >= n),
                "ranks": kinds,
            }
        )

    def _raise(
        self, layer: int, verdicts: list[tuple[int, int, int]], step: int | None = None
    ) -> None:
        n = len(FINDINGS)
        worst = max(v[0] % n for v in verdicts)
        ranks = [r for r, v in enumerate(verdicts) if v[0] % n == worst]
        _, was, found = verdicts[ranks[0]]
        raise RecomputeMismatch(
            f"step {self.step if step is None else step}, layer {layer}: the recompute's "
            f"dispatch returned {describe(FINDINGS[worst], was, found)} (ranks {ranks})"
        )
