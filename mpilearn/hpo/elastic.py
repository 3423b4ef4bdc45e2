"""A sweep under ULFM (``search.elastic``, ``mpilearn-run --min-np``): a lost rank costs its
block's trial, never the sweep.

- **Detection.** Every communicator returns errors instead of aborting. The coordinator sees a
  lost rank as MPI's failure notice on its any-source probe of the world, acknowledges it and
  reads which ranks failed (:func:`newly_failed`); a block rank sees it in its block's or
  fold's next collective (every rank of a block is in each of its folds, :func:`check`, so
  that is within a step).
- **The block retires.** Its survivors revoke the block's communicators (every one of them
  leaves what it was in), the leader tells the coordinator (``lost``, ``retired``), and they
  wait for the sweep's end. Forming a smaller block would need a new block communicator agreed
  by ranks that are in different places of the trial, and the layout's fold shapes; retiring
  is the simple sound choice: the trial is requeued, and the sweep goes on with fewer blocks.
- **The trial runs again first**, on the next block that asks, from its folds' checkpoints
  (``Coordinator.lose``; journalled ``block_lost`` and ``interrupted``).
- **The end.** The survivors shrink the world (:func:`survivors`), then leave as a sweep
  does. If the coordinator (world rank 0) was lost, nobody holds the searcher's state in
  memory: the survivors exit 75 and ``--resume`` takes over from the journal, which requeues
  the trials in flight (a survivor taking over the coordinator would have to rebuild the
  searcher and the pruner while blocks are mid-trial: the resume does exactly that, tested).
"""
from __future__ import annotations

from typing import List, Optional

from ..core import comm as mcomm
from ..errors import BELOW_MIN_EXIT, UsageError

COORDINATOR_LOST_EXIT = BELOW_MIN_EXIT  # 75: requeue me, resume from the journal


def check(config: dict, task=None) -> None:
    """Bad input (UsageError) for what an elastic sweep cannot do (yet)."""
    from ..core import membership
    from ..train.elastic import ELASTIC_ALGORITHMS

    s, t = config["search"], config["train"]
    if not s.get("elastic"):
        return
    if not membership.supported():
        raise UsageError("search.elastic: true needs an MPI with ULFM (Open MPI 5 under "
                         "'mpirun --with-ft ulfm'); this mpi4py's MPI has no Comm.Revoke/Shrink")
    if s["fold_mode"] == "parallel" and s["folds"] > 1:
        raise UsageError(
            f"search.elastic: {s['folds']} folds in parallel put a block's ranks in different "
            "folds, so a lost rank's block-mates would train their own fold on and race the "
            "requeued trial for its checkpoints; set search.fold_mode: sequential (every rank "
            "of a block in each fold) or search.folds: 1")
    if t["algorithm"] not in ELASTIC_ALGORITHMS:
        raise UsageError(f"search.elastic: train.algorithm={t['algorithm']} is not elastic (its "
                         "master would wait for a lost worker); use train.algorithm=allreduce or local_sgd")
    if t["backend"] != "mpi":
        raise UsageError(f"search.elastic needs train.backend=mpi (ULFM), not {t['backend']}")
    if getattr(task, "framework", "") == "keras":
        raise UsageError("search.elastic: Keras tasks are not elastic yet (a lost rank inside "
                         "a Keras step is not reported as MPI's failure); use a PyTorch model")


def returning_errors(*comms) -> None:
    """A lost rank raises MPI.Exception on these communicators instead of aborting the job."""
    MPI = mcomm.mpi()
    for c in comms:
        c.Set_errhandler(MPI.ERRORS_RETURN)


def failed_ranks(comm, within=None) -> List[int]:
    """The ranks of ``comm`` (translated into ``within``'s ranks, if given) that this process
    knows failed, acknowledged (an any-source operation on ``comm`` works again)."""
    MPI = mcomm.mpi()
    comm.Ack_failed()
    group = comm.Get_failed()
    ranks = list(range(group.Get_size()))
    target = (within or comm).Get_group()
    return sorted(r for r in MPI.Group.Translate_ranks(group, ranks, target)
                  if r != MPI.UNDEFINED)


def newly_failed(comm, seen: set) -> List[int]:
    """The coordinator's side: the world ranks lost since the last call (added to ``seen``)."""
    new = [r for r in failed_ranks(comm) if r not in seen]
    seen.update(new)
    return new


def describe(ranks, hosts) -> str:
    return ", ".join(f"rank {r} on host {hosts[r] if hosts else '?'}" for r in ranks) + " lost"


def retire(world, block_comms, leader: bool, block: int, hosts, tag: int) -> None:
    """A block rank that saw a failure: revoke the block's communicators (the others leave
    what they wait in), and the leader tells the coordinator (a ``tag`` message), unless the
    coordinator is the one lost (then the end's shrink says so)."""
    MPI = mcomm.mpi()
    for c in block_comms:
        try:
            c.Revoke()
        except MPI.Exception:  # revoked already by a block-mate
            pass
    if not leader:
        return
    try:
        lost = failed_ranks(block_comms[0], within=world)
        if 0 in failed_ranks(world):
            return
        world.send({"block": block, "retired": True,
                    "lost": describe(lost, hosts) if lost else "a rank of the block lost"},
                   dest=0, tag=tag)
    except MPI.Exception:  # the coordinator went meanwhile: the end's shrink says so
        pass


def survivors(ctx, world) -> tuple:
    """Collective over every surviving rank, at the sweep's end: the world shrunk to them
    (the exit then skips MPI_Finalize, which can hang after a loss: ``core/comm``), and whether
    the coordinator (world rank 0) is among them."""
    MPI = mcomm.mpi()
    shrunk = world.Shrink()
    returning_errors(shrunk)
    if shrunk.Get_size() == world.Get_size():
        shrunk.Free()
        return world, True
    kept = MPI.Group.Translate_ranks(shrunk.Get_group(), [0], world.Get_group())
    mcomm.replace_comm(ctx, shrunk)
    return shrunk, kept[0] == 0


def coordinator_lost_line(host: Optional[str], output: str) -> str:
    return (f"mpilearn: the coordinator (rank 0 on {host or '?'}) was lost; the sweep stops "
            f"(exit {COORDINATOR_LOST_EXIT}); continue with --resume auto: the journal "
            f"{output}/journal.jsonl requeues the trials in flight, each fold from its "
            "checkpoint")
