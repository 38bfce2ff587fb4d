"""Where each rank runs and how the ranks talk: placement, process groups, agreement.

Every rank must reach the same verdict: placement picks each rank's GPU (ranks sharing one use
gloo, since NCCL refuses two ranks on a GPU), and ``agree`` merges a step over all ranks through
a gloo group the backend never touches. A rank whose step ended in an error (the backend raised,
so it skipped the step's remaining collectives) does not wait at ``agree`` for peers that may be
blocked in one of them: it waits a few seconds for them in the job's store, then gives up
(:class:`PeersLeftWaiting`). torch is imported only inside the functions that need it. See
docs/probes.md, sections "Where each rank runs" and "Ranks in step".
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ep_image.probes import _supervise
from ep_image.probes._report import EXIT_USAGE, Status, Step, merge_exit_codes, one_line, worst

SHARED_GPU_LABEL = "shared GPU: not a link figure"
#: The bandwidth of a job of one rank: every token stays on its GPU, no link is crossed.
ONE_RANK_LABEL = "one rank: no link crossed, not a link figure"

#: Seconds a rank whose step raised waits for its peers to reach the same agreement before it
#: counts them as blocked in a collective it never joined (capped by --timeout).
PEER_WAIT_SECONDS = 5.0


@dataclass(frozen=True)
class RankEnv:
    """This process's place in the job, from torchrun's environment (one rank without it)."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    launched: bool  # WORLD_SIZE and MASTER_ADDR present: use env:// rendezvous

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> RankEnv:
        env = os.environ if environ is None else environ
        world = int(env.get("WORLD_SIZE", "1"))
        return cls(
            rank=int(env.get("RANK", "0")),
            world=world,
            local_rank=int(env.get("LOCAL_RANK", "0")),
            local_world=int(env.get("LOCAL_WORLD_SIZE", str(world))),
            launched="WORLD_SIZE" in env and "MASTER_ADDR" in env,
        )

    @property
    def nodes(self) -> int:
        """Nodes in the job, assuming the same number of ranks on each (as torchrun does)."""
        return max(1, self.world // max(1, self.local_world))

    @property
    def node(self) -> int:
        """This rank's node: torchrun's GROUP_RANK (two agents on one host are two nodes)."""
        group_rank = os.environ.get("GROUP_RANK")
        return int(group_rank) if group_rank is not None else self.rank // max(1, self.local_world)


def topology(facts: list[dict[str, Any]]) -> dict[str, Any]:
    """The job's layout from every rank's facts: nodes, ranks per node, who is where.

    Raises ValueError when nodes hold different numbers of ranks (EP backends assume equal
    NVLink domains).
    """
    local_worlds = sorted({f["local_world"] for f in facts})
    if len(local_worlds) > 1:
        raise ValueError(
            f"nodes run different numbers of ranks (LOCAL_WORLD_SIZE {local_worlds}): start "
            "the same number of ranks on every node"
        )
    nodes = len({f["node"] for f in facts})
    return {
        "world_size": len(facts),
        "local_world_size": local_worlds[0],
        "nodes": nodes,
        "internode": nodes > 1,
        "ranks": [
            {"rank": f["rank"], "local_rank": f["local_rank"], "node": f["node"]} for f in facts
        ],
    }


@dataclass(frozen=True)
class Placement:
    """Which device this rank uses and whether its GPU is shared with other local ranks.

    ``problem`` is set when the ranks cannot be placed (more local ranks than GPUs allow);
    the probe then runs on gloo without a GPU so every rank can still agree on the verdict.
    """

    use_gpu: bool
    gpu_index: int | None
    gpus: int
    ranks_per_gpu: int
    shared: bool
    problem: tuple[str, str] | None = None  # (detail, hint)

    @property
    def group_backend(self) -> str:
        return "nccl" if self.use_gpu and not self.shared else "gloo"


def device_facts(env: RankEnv, wants_gpu: bool) -> dict[str, Any]:
    """What this rank would use: the GPUs it sees, its pick (round-robin), that GPU's UUID.

    The UUID is what tells shared GPUs from distinct ones: under Slurm's per-task binding
    every rank sees one GPU as cuda:0, and those are eight different GPUs, while two ranks
    that see the same single GPU share it.
    """
    import socket

    facts: dict[str, Any] = {
        "rank": env.rank,
        "local_rank": env.local_rank,
        "local_world": env.local_world,
        "node": env.node,
        "host": socket.gethostname(),
        "gpus": 0,
    }
    if not wants_gpu:
        return facts
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    facts["gpus"] = gpus
    if gpus:
        index = env.local_rank % gpus
        props = torch.cuda.get_device_properties(index)
        uuid = getattr(props, "uuid", None)
        facts.update(index=index, uuid=str(uuid) if uuid else f"{facts['host']}:{index}")
    return facts


def decide_placement(
    facts: list[dict[str, Any]], rank: int, wants_gpu: bool, ranks_per_gpu: int
) -> Placement:
    """Place ``rank`` from every rank's :func:`device_facts`; all ranks decide the same.

    A rank never falls back to the CPU alone: either every rank has a GPU of its own (or a
    share of one that ``ranks_per_gpu`` allows), or the probe runs on gloo without GPUs and
    reports why. (The probe once put every rank whose local index was past the visible GPU
    count on the CPU and handed the backend host tensors: with one GPU per rank, as Slurm
    binds them, ranks 1-7 of a node; with ranks sharing a GPU, a kernel read host memory.)
    """
    own = facts[rank]
    if not wants_gpu:
        return Placement(False, None, own["gpus"], ranks_per_gpu, False)
    blind = [f["rank"] for f in facts if not f["gpus"]]
    if blind:
        if len(blind) == len(facts):
            return Placement(False, None, 0, ranks_per_gpu, False)
        detail = f"ranks {blind} see no GPU while the others do"
        hint = "give every rank a GPU (check CUDA_VISIBLE_DEVICES and the launcher's binding)"
        return Placement(False, None, own["gpus"], ranks_per_gpu, False, (detail, hint))
    sharing: dict[str, list[int]] = {}
    for f in facts:
        sharing.setdefault(f["uuid"], []).append(f["rank"])
    most = max(len(ranks) for ranks in sharing.values())
    if most > ranks_per_gpu:
        crowded = next(ranks for ranks in sharing.values() if len(ranks) == most)
        gpus = len(sharing)
        detail = (
            f"{len(facts)} ranks on {gpus} GPU(s): ranks {crowded} share one GPU "
            f"({ranks_per_gpu} rank(s) per GPU allowed)"
        )
        if ranks_per_gpu == 1:
            hint = (
                "start at most one rank per GPU (torchrun --nproc-per-node <= GPUs), or pass "
                f"--ranks-per-gpu {most} to share GPUs for a functional check (its bandwidth "
                "is not a link figure)"
            )
        else:
            hint = f"start fewer ranks, or raise --ranks-per-gpu to {most}"
        return Placement(False, None, own["gpus"], ranks_per_gpu, False, (detail, hint))
    return Placement(True, own["index"], own["gpus"], ranks_per_gpu, most > 1)


def exchange(env: RankEnv, store: Any, key: str, value: Any, timeout: float) -> list[Any]:
    """Every rank's JSON-able ``value`` through the rendezvous store, before any group exists."""
    if store is None:
        return [value]
    store.set(f"{key}/{env.rank}", json.dumps(value))
    keys = [f"{key}/{r}" for r in range(env.world)]
    store.wait(keys, datetime.timedelta(seconds=timeout))
    return [json.loads(store.get(k)) for k in keys]


def connect_store(env: RankEnv, timeout: float) -> Any:
    """A client of the job's rendezvous store (None for a lone process).

    The probe's supervisor serves it, or torchrun's agent does
    (``TORCHELASTIC_USE_AGENT_STORE``); the ranks meet there to place themselves and then
    build their process groups on it.
    """
    if not env.launched:
        return None
    import torch.distributed as dist

    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout),
    )
    run = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"ep_probe/{run}/{attempt}/", store)


@dataclass
class Runtime:
    """Process groups and placement for one run."""

    env: RankEnv
    placement: Placement
    device: Any  # torch.device
    ep_group: Any  # dist.ProcessGroup handed to the backend
    ctrl_group: Any  # gloo group for agreement, never the backend's
    timeout: float  # seconds, for collectives and the trial import
    node_of_rank: list[int] = dataclasses.field(default_factory=list)
    store: Any = None  # the job's store (None for one rank): ranks mark each agreement there
    agreements: int = 0  # agreements reached so far; the same sequence on every rank

    @property
    def use_gpu(self) -> bool:
        return self.placement.use_gpu


def sync(rt: Runtime) -> None:
    """Wait for this rank's GPU to finish what was queued (nothing to wait for on the CPU)."""
    if rt.use_gpu:
        import torch

        torch.cuda.synchronize(rt.device)


def init_distributed(
    env: RankEnv, placement: Placement, timeout: float, store: Any = None
) -> Runtime:
    """The default group (the backend's) and a gloo group for the probe's own messages."""
    import torch
    import torch.distributed as dist

    kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout)}
    if placement.use_gpu:
        torch.cuda.set_device(placement.gpu_index)
        device = torch.device("cuda", placement.gpu_index)
        if placement.group_backend == "nccl":
            kwargs["device_id"] = device  # eager NCCL init, so DeepEP can reuse the communicator
    else:
        device = torch.device("cpu")
    backend = placement.group_backend
    if store is not None:
        pg_store = dist.PrefixStore("pg/", store)
        dist.init_process_group(
            backend, store=pg_store, rank=env.rank, world_size=env.world, **kwargs
        )
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    ctrl = dist.new_group(backend="gloo", timeout=kwargs["timeout"])
    return Runtime(env, placement, device, dist.group.WORLD, ctrl, timeout, store=store)


def all_gather_json(obj: Any, group: Any, world: int) -> list[Any]:
    """Every rank's JSON-able ``obj``, in rank order.

    Not ``dist.all_gather_object``: that decodes through ``Tensor.numpy()``, and the probes run
    where numpy is absent too. Bytes travel as uint8 tensors over the gloo group.
    """
    import torch
    import torch.distributed as dist

    # default=str: an odd value in a step's data must not make one rank skip the collective.
    payload = torch.tensor(list(json.dumps(obj, default=str).encode()), dtype=torch.uint8)
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


class PeersLeftWaiting(Exception):
    """This rank's step ended in an error and its peers did not reach the agreement after it:
    they are blocked in a collective this rank skipped, so no merged verdict can come."""

    def __init__(self, step: Step, waiting: list[int]) -> None:
        super().__init__(f"ranks {waiting} did not reach the end of {step.name}")
        self.step = step
        self.waiting = waiting


def arrive(rt: Runtime, step: Step) -> None:
    """Mark this rank's arrival at the next agreement; when its step ended in an error, wait
    (briefly) until every peer has arrived too, or raise :class:`PeersLeftWaiting`.

    A step that failed its checks still made every call (the checks never raise), so its
    peers arrive; one that raised skipped the step's later collectives, and a peer that did
    not raise as well is blocked in one of them until the group's timeout.
    """
    rt.agreements += 1
    if rt.store is None or rt.env.world == 1:
        return
    key = f"agree/{rt.agreements}/"
    # What this rank's supervisor and its peers' read to tell a peer that stopped making
    # progress in this step (stall.py): when the step began here, when it ended, how.
    arrival = {
        "status": step.status.value,
        "step": step.name,
        "started": _supervise.progress.state.get("started"),
        "arrived": time.time(),
        "detail": one_line(step.detail, 300),
    }
    rt.store.set(f"{key}{rt.env.rank}", json.dumps(arrival))
    _supervise.progress.update(agreed=rt.agreements)
    if step.status != Status.ERROR:
        return
    deadline = time.monotonic() + min(PEER_WAIT_SECONDS, rt.timeout)
    while True:
        waiting = [r for r in range(rt.env.world) if not rt.store.check([f"{key}{r}"])]
        if not waiting:
            return
        if time.monotonic() >= deadline:
            raise PeersLeftWaiting(step, waiting)
        time.sleep(0.05)


def agree(
    rt: Runtime, step: Step, summarize: Callable[[Step, list[Step]], None] | None = None
) -> Step:
    """Merge one step over all ranks: worst status wins, its first rank's detail is shown."""
    arrive(rt, step)
    gathered = all_gather_json(step.to_json(), rt.ctrl_group, rt.env.world)
    per_rank = [Step.from_json(obj) for obj in gathered]
    status = worst(s.status for s in per_rank)
    if all(s.status == per_rank[0].status for s in per_rank):
        status = per_rank[0].status  # every rank alike: "info" or "not run" stays what it is
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


def agree_code(rt: Runtime, code: int) -> int:
    """All ranks leave with the same, most severe, exit code."""
    codes = all_gather_json(code, rt.ctrl_group, rt.env.world)
    return merge_exit_codes([int(c) for c in codes]) if codes else EXIT_USAGE
