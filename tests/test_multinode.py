"""check_ep across two torchrun agents ("nodes") on this machine: gloo, the torch backend.

Why these tests: a multi-node EP job is one torchrun agent per node, each starting its local
ranks, meeting at a rendezvous on the first node. No machine here has two nodes, but the
plumbing is the same when both agents run on one host: ``--nnodes 2 --node-rank 0/1
--nproc-per-node 2 --master-addr 127.0.0.1``. These tests launch exactly that (real torchrun,
real processes, real gloo) and check what must hold on a cluster: every rank gets its global
and local place, the EP group spans both nodes, the verdict is agreed across nodes, and only
global rank 0 prints the table and writes the JSON. Each agent is given its own --json path,
as if each node had its own disk, so a report from the wrong node would show.

What today's probe does not yet do (tell intranode from internode ranks, count nodes) is
asserted as a correct probe must do it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = "ep_image.probes.check_ep"
NODE_BACKENDS = ROOT / "tests" / "fixtures" / "node_backends.py"
NNODES, NPROC = 2, 2
WORLD = NNODES * NPROC
# Small layer, few iterations: 4 ranks and 2 agents share 2 cores.
TOKENS, HIDDEN, EXPERTS, TOPK = 64, 64, 16, 4
ARGS = [
    "--tokens", str(TOKENS), "--hidden", str(HIDDEN), "--experts", str(EXPERTS),
    "--topk", str(TOPK), "--iters", "3", "--warmup", "1", "--replays", "2", "--timeout", "120",
]  # fmt: skip
#: torchrun's own variables, never inherited from the caller.
LAUNCH_VARS = {
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
}  # fmt: skip


@dataclass
class Agent:
    node: int
    proc: subprocess.CompletedProcess[str]
    json_path: Path

    @property
    def report(self) -> dict | None:
        return json.loads(self.json_path.read_text()) if self.json_path.exists() else None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_two_nodes(tmp: Path, probe_args: list[str], env: dict[str, str]) -> list[Agent]:
    """Start one torchrun agent per node, concurrently, and wait for both."""
    port = free_port()
    procs = []
    for node in range(NNODES):
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(NNODES), "--node-rank", str(node),
            "--nproc-per-node", str(NPROC),
            "--master-addr", "127.0.0.1", "--master-port", str(port),
            "-m", PROBE, *probe_args, "--json", str(tmp / f"node{node}.json"),
        ]  # fmt: skip
        procs.append(
            subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
                cwd=tmp,
            )
        )
    agents = []
    try:
        for node, proc in enumerate(procs):
            out, err = proc.communicate(timeout=420)
            done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
            agents.append(Agent(node, done, tmp / f"node{node}.json"))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return agents


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(extra)
    return env


def outputs(agents: list[Agent]) -> str:
    return "\n".join(
        f"--- node {a.node} rc={a.proc.returncode}\n{a.proc.stdout}\n{a.proc.stderr[-3000:]}"
        for a in agents
    )


def step(report: dict, name: str) -> dict:
    return next(s for s in report["steps"] if s["name"] == name)


@pytest.fixture(scope="module")
def passing_run(tmp_path_factory: pytest.TempPathFactory) -> list[Agent]:
    tmp = tmp_path_factory.mktemp("two_nodes")
    return run_two_nodes(tmp, ["--backend", "torch", *ARGS], clean_env())


def test_both_agents_pass(passing_run: list[Agent]) -> None:
    assert [a.proc.returncode for a in passing_run] == [0, 0], outputs(passing_run)


def test_one_report_from_global_rank_0_only(passing_run: list[Agent]) -> None:
    node0, node1 = passing_run
    # Node 0's agent hosts global rank 0: one table, one JSON.
    assert node0.proc.stdout.count("result: passed (exit 0)") == 1, outputs(passing_run)
    assert node0.proc.stdout.count("check_ep\n") == 1
    assert node0.report is not None and node0.report["exit_code"] == 0
    # Node 1 runs ranks 2 and 3: it prints no table and writes no report.
    assert "result:" not in node1.proc.stdout and "check_ep" not in node1.proc.stdout
    assert node1.report is None


def test_report_covers_every_rank_of_both_nodes(passing_run: list[Agent]) -> None:
    report = passing_run[0].report
    assert report is not None
    assert report["world_size"] == WORLD
    assert report["backend"] == "torch"
    assert all(s["status"] == "pass" for s in report["steps"]), report["steps"]
    n = report["numbers"]
    assert len(n["received_per_rank"]) == WORLD
    assert n["received_per_rank"] == n["expected_per_rank"]
    # Independent of the probe's reference: each (token, expert) pair arrives exactly once.
    assert len(n["received_per_expert"]) == EXPERTS
    assert sum(n["received_per_expert"]) == WORLD * TOKENS * TOPK
    for name in ("dispatch_combine", "backward", "replay", "bandwidth"):
        assert len(step(report, name)["data"]["ranks"]) == WORLD, name
    assert f"experts {EXPERTS} ({EXPERTS // WORLD}/rank)" in passing_run[0].proc.stdout


def test_report_tells_intranode_from_internode(passing_run: list[Agent]) -> None:
    report = passing_run[0].report
    assert report is not None
    topology = report["topology"]
    assert topology["nodes"] == NNODES
    assert topology["local_world_size"] == NPROC
    assert topology["internode"] is True
    assert topology["ranks"] == [
        {"rank": r, "local_rank": r % NPROC, "node": r // NPROC} for r in range(WORLD)
    ]
    assert f"world {WORLD} = {NNODES} nodes x {NPROC} ranks" in passing_run[0].proc.stdout


def test_bandwidth_is_split_into_nvlink_and_rdma_bytes(passing_run: list[Agent]) -> None:
    """As DeepEP's internode test: bytes from the same node's ranks apart from the others'."""
    report = passing_run[0].report
    assert report is not None
    ranks = step(report, "bandwidth")["data"]["ranks"]
    assert len(ranks) == WORLD
    for data in ranks:
        assert data["nvl_bytes"] + data["rdma_bytes"] == data["bytes"], data
        assert data["nvl_bytes"] > 0 and data["rdma_bytes"] > 0, data  # random routing
        assert data["dispatch_rdma_gbs"] > 0 and data["combine_nvl_gbs"] > 0
    assert report["numbers"]["dispatch_rdma_gbs"] > 0


def test_fault_on_the_second_node_reaches_rank_0s_report(tmp_path: Path) -> None:
    """Ranks 2 and 3 (node 1) lose a token; node 0's ranks are exact. The agreed verdict,
    written by rank 0 on node 0, must name the failing rank of the other node."""
    placement = tmp_path / "placement"
    placement.mkdir()
    agents = run_two_nodes(
        tmp_path,
        ["--backend-class", f"{NODE_BACKENDS}:LosesTokensOffFirstNode", *ARGS],
        clean_env(EP_TEST_PLACEMENT_DIR=str(placement)),
    )
    node0, node1 = agents
    # torchrun turns any non-zero worker code into 1; the probe's own code is in the report.
    assert [a.proc.returncode for a in agents] == [1, 1], outputs(agents)
    report = node0.report
    assert report is not None and node1.report is None, outputs(agents)
    assert report["exit_code"] == 1 and report["result"] == "failed"
    dc = step(report, "dispatch_combine")
    assert dc["status"] == "fail"
    assert dc["detail"].startswith("rank 2: "), dc["detail"]
    assert "(and 1 more ranks)" in dc["detail"]
    assert "result: failed (exit 1)" in node0.proc.stdout
    assert "result:" not in node1.proc.stdout

    # The EP group the probe built spans both nodes, in torchrun's rank order.
    records = sorted(
        (json.loads(p.read_text()) for p in placement.glob("rank*.json")),
        key=lambda r: r["rank"],
    )
    assert [r["rank"] for r in records] == list(range(WORLD))
    for r in records:
        assert r["ep_rank"] == r["rank"], r  # the EP group is the whole job, in launch order
        assert r["ep_size"] == r["world_size"] == WORLD, r
        assert r["local_world_size"] == NPROC, r
        assert r["local_rank"] == r["rank"] % NPROC, r
        assert r["group_rank"] == r["rank"] // NPROC, r  # torchrun's node rank
    assert len({r["pid"] for r in records}) == WORLD
