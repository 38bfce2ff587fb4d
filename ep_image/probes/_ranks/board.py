"""A notice board in the job's key-value store: how each rank's backend process ended.

Each rank's supervisor posts its backend's end here, so rank 0 can still name the rank that
failed first when a crash makes torchrun tear every rank down, and, while it runs, how far its
backend calls got, so a peer waiting in a call this rank left can tell (``stall.py``). The
store is torchrun's agent store or one that rank 0's supervisor serves; see docs/probes.md,
section "Backends".
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import time
from typing import Any

_AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"


class Board:
    """One job's board: ``post`` this rank's outcome, ``read`` everyone's."""

    def __init__(self, store: Any, prefix: str, rank: int, world: int) -> None:
        self.store = store
        self.prefix = prefix
        self.rank = rank
        self.world = world

    @staticmethod
    def must_serve(rank: int, world: int) -> bool:
        """Whether this supervisor serves the job's store: rank 0, when no torchrun agent does."""
        launched = world > 1 and "MASTER_ADDR" in os.environ
        return launched and rank == 0 and os.environ.get(_AGENT_STORE_ENV) != "True"

    @classmethod
    def connect(cls, rank: int, world: int, serve: bool, timeout: float) -> Board | None:
        """Join (or, with ``serve``, host) the store; None for one rank or without a store."""
        if world <= 1 or "MASTER_ADDR" not in os.environ:
            return None
        import torch.distributed as dist

        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        store = dist.TCPStore(
            host,
            port,
            is_master=serve,
            timeout=datetime.timedelta(seconds=timeout),
            wait_for_workers=False,
        )
        run = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return cls(store, f"ep_probe/{run}/{attempt}/", rank, world)

    def post(self, outcome: dict[str, Any]) -> None:
        """Publish this rank's outcome; a failure also bumps the shared failure count."""
        try:
            self.store.set(f"{self.prefix}rank{self.rank}", json.dumps(outcome))
            if outcome.get("how") not in ("finished", "stopped"):
                self.store.add(f"{self.prefix}failed", 1)
        except Exception:  # the board is best effort: rank 0 may already be gone
            pass

    def arrivals(self, agreement: int) -> dict[int, dict[str, Any]]:
        """The ranks that reached ``agreement`` so far, with their arrival (``runtime.arrive``)."""
        import torch.distributed as dist

        # The ranks write through a PrefixStore of this prefix (ranks.connect_store), which
        # joins prefix and key its own way: read through one too.
        view = dist.PrefixStore(self.prefix, self.store)
        found: dict[int, dict[str, Any]] = {}
        for rank in range(self.world):
            key = f"agree/{agreement}/{rank}"
            try:
                if view.check([key]):
                    found[rank] = json.loads(view.get(key))
            except Exception:  # the board is best effort: a peer's store may be gone
                return found
        return found

    def post_calls(self, progress: dict[str, Any]) -> None:
        """Publish how far this rank's backend calls got (``stall.call_progress``); best
        effort, as every post: rank 0 may already be gone."""
        with contextlib.suppress(Exception):
            self.store.set(f"{self.prefix}calls{self.rank}", json.dumps(progress))

    def calls(self) -> dict[int, dict[str, Any]]:
        """Every rank's call progress posted so far (rank -> ``stall.call_progress``)."""
        found: dict[int, dict[str, Any]] = {}
        for rank in range(self.world):
            key = f"{self.prefix}calls{rank}"
            try:
                if self.store.check([key]):
                    found[rank] = json.loads(self.store.get(key))
            except Exception:  # the board is best effort: a peer's store may be gone
                return found
        return found

    def failures(self) -> int:
        """How many ranks have posted a failure so far."""
        try:
            return int(self.store.add(f"{self.prefix}failed", 0))
        except Exception:
            return 0

    def read(self, wait: float) -> dict[int, dict[str, Any]]:
        """Every posted outcome; waits up to ``wait`` seconds for ranks that have not posted."""
        deadline = time.monotonic() + wait
        found: dict[int, dict[str, Any]] = {}
        while True:
            for rank in range(self.world):
                if rank in found:
                    continue
                key = f"{self.prefix}rank{rank}"
                try:
                    if self.store.check([key]):
                        found[rank] = json.loads(self.store.get(key))
                except Exception:
                    return found
            if len(found) == self.world or time.monotonic() >= deadline:
                return found
            time.sleep(0.1)
