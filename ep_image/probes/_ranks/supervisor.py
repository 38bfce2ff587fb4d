"""One rank's supervisor: it runs the backend in a watched child and speaks for it when the child
does not finish.

Why this module exists: a backend can crash, exit, hang or raise on some ranks only (leaving the
others blocked in its collective), and under torchrun a peer's death tears every rank down; this
process (which holds no CUDA state) turns each of these into a verdict: it posts how its child
ended on the job's board (and, while it runs, how far its backend calls got: ``stall.py``), and
on rank 0 it writes the table and the JSON report of a run that did not finish, naming the rank
and the step (``output.report_unfinished``). A rank stopped because its launcher was
interrupted has no verdict to give: the launcher says so, once (``launch.py``).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

from ep_image.probes import _supervise
from ep_image.probes._ranks import launch, output, preflight, stall, worker
from ep_image.probes._ranks.board import Board
from ep_image.probes._ranks.runtime import RankEnv
from ep_image.probes._ranks.selection import select_backend
from ep_image.probes._ranks.types import ProbeKind, RunOptions, not_run
from ep_image.probes._report import EXIT_UNUSABLE, Step, exit_code_of


def run(kind: ProbeKind, options: RunOptions, argv: list[str]) -> int:
    """Start the local ranks (``--nproc-per-node``: ``argv`` again, without that flag), or be
    one rank: its supervisor's exit code, which rank 0 also leaves for a local launcher.
    What can be refused before any rank starts is refused first (``preflight``)."""
    env = RankEnv.from_environ()
    missing = preflight.torch_missing(kind)
    if missing is not None:
        if options.nproc_per_node:  # the ranks it would have started, on this one node
            n = options.nproc_per_node
            env = dataclasses.replace(env, world=n, local_world=n)
        return report_verdict(kind, options, env, missing)
    if options.nproc_per_node:
        preflight.check_local_launch(kind, options, preflight.visible_gpus())
        return launch.launch_local(options.nproc_per_node, kind.module, argv, kind.prog)
    code = supervise(kind, options, env)
    if env.rank == 0:
        launch.write_exit_code(code)
    return code


def report_verdict(kind: ProbeKind, options: RunOptions, env: RankEnv, verdict: Step) -> int:
    """The table and report of a run that ends before any backend process starts, on
    ``verdict`` (the import step's: a backend or torch that is not installed)."""
    sel = select_backend(options)
    steps = [verdict] + [not_run(n, verdict) for n in kind.step_names[1:]]
    code = exit_code_of(steps, options.require)
    return output.finish(kind, options, env, sel, steps, {}, code)


def supervise(kind: ProbeKind, options: RunOptions, env: RankEnv) -> int:
    """Run the backend in a watched child; report a crash, early exit or hang as exit 3."""
    sel = select_backend(options)
    if sel.verdict is not None:
        return report_verdict(kind, options, env, sel.verdict)

    if env.launched:
        # This process talks to the job's store (torch's TCPStore): import torch once, before
        # the fork, so the backend process inherits it instead of importing it again (no CUDA
        # is touched here, so the fork stays safe).
        import torch.distributed  # noqa: F401
    serve = Board.must_serve(env.rank, env.world)
    board_box: list[Board | None] = []

    def peer_failed() -> bool:
        if not board_box:  # joined lazily: the store may come up after the child starts
            board_box.append(Board.connect(env.rank, env.world, serve, options.timeout))
        board = board_box[0]
        return board is not None and board.failures() > 0

    last_progress: list[dict[str, Any]] = []  # what this rank last posted of its calls

    def stalled(state: dict[str, Any]) -> dict[str, Any] | None:
        """Whether this rank's backend process stopped in a step its peers finished, or in a
        backend call they returned from without it; posts how far its own calls got."""
        board = board_box[0] if board_box else None
        if board is None:
            return None
        progress = stall.call_progress(state)
        if last_progress != [progress]:
            board.post_calls(progress)
            last_progress[:] = [progress]
        heading = int(state.get("agreed", 0)) + 1
        found = stall.stalled(state, board.arrivals(heading), env.rank)
        if found is None and stall.in_call_for(state) > stall.STALL_FLOOR:
            found = stall.stalled_in_call(state, board.calls(), env.rank)
        return found

    watch = _supervise.Watch(
        step_deadline=options.timeout,
        peer_failed=peer_failed,
        stalled=stalled if env.world > 1 else None,
    )
    outcome = _supervise.run_supervised(
        lambda: worker.work(kind, options, env, sel), watch, who=_who(kind, env)
    )
    if outcome.how == "stopped" and (signame := launch.interrupted()) is not None:
        # The launcher was interrupted and stopped the ranks: it says so, once; no rank has a
        # verdict to give.
        return launch.interrupted_code(signame)
    raised = outcome.progress.get("raised")
    if outcome.how == "finished" and raised:
        # The backend raised here while peers were blocked in its collective: a failure on the
        # board, so their supervisors stop them now instead of after a collective timeout.
        outcome = dataclasses.replace(outcome, how="raised", code=EXIT_UNUSABLE)
    if env.world > 1 and not board_box:
        board_box.append(Board.connect(env.rank, env.world, serve, options.timeout))
    board = board_box[0] if board_box else None
    posted = {**outcome.to_json(), "time": time.time()}
    if raised:
        posted["raised"] = raised
    if board is not None:
        board.post(posted)
    if outcome.how == "finished":
        if board is not None and env.rank == 0 and serve:
            board.read(wait=10.0)  # keep serving the store until every rank is done with it
        return outcome.code
    if env.rank != 0:
        if outcome.how != "stopped":
            if outcome.fault_log:
                print(outcome.fault_log.rstrip(), file=sys.stderr)
            said = f": {raised['detail']}" if raised else ""
            print(
                f"{kind.prog}: rank {env.rank}: {outcome.how} during {outcome.step}{said}",
                file=sys.stderr,
            )
        return outcome.code
    outcomes = board.read(wait=5.0) if board is not None else {}
    outcomes[env.rank] = posted
    return output.report_unfinished(kind, options, env, sel, outcome, outcomes)


def _who(kind: ProbeKind, env: RankEnv) -> str:
    """How this rank's lines begin: the probe's name, and the rank where there are several."""
    return f"{kind.prog}: rank {env.rank}" if env.world > 1 else kind.prog
