"""A sweep under ULFM (``search.elastic``, ``mpilearn-run --min-np``): a lost rank costs its
block's trial, never the sweep.

- **Detection.** Every communicator returns errors instead of aborting. The coordinator sees a
  lost rank as MPI's failure notice on its any-source probe of the world, acknowledges it and
  reads which ranks failed (:func:`newly_failed`); a block rank sees it in its fold's next
  collective, or (a rank of another fold, with folds in parallel) in :class:`BlockWatch`'s
  any-source receive on the block, tested after every step: at the end of the step in which
  MPI tells it (its notice arrives at the rank's own MPI calls: 0.1-5 s here).
- **The block retires.** Its survivors revoke the block's communicators (every one of them
  leaves what it was in), shrink the block to agree that all of them stopped, and the first
  of them tells the coordinator (``lost``, ``retired``); they wait for the sweep's end.
  Forming a smaller block would need the layout's fold shapes from ranks that are in
  different places of the trial; retiring is the simple sound choice: the trial is requeued,
  and the sweep goes on with fewer blocks.
- **The trial runs again first**, on the next block that asks, from its folds' checkpoints
  (``Coordinator.lose``; journalled ``block_lost`` and ``interrupted``), once the block's
  survivors said they stopped (or none is left): no fold of the old block writes its
  checkpoints while the new one reads them.
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


def check(config: dict) -> None:
    """Bad input (UsageError) for what an elastic sweep cannot do (yet)."""
    from ..core import membership
    from ..train.elastic import ELASTIC_ALGORITHMS

    s, t = config["search"], config["train"]
    if not s.get("elastic"):
        return
    if not membership.supported():
        raise UsageError("search.elastic: true needs an MPI with ULFM (Open MPI 5 under "
                         "'mpirun --with-ft ulfm'); this mpi4py's MPI has no Comm.Revoke/Shrink")
    if t["algorithm"] not in ELASTIC_ALGORITHMS:
        raise UsageError(f"search.elastic: train.algorithm={t['algorithm']} is not elastic (its "
                         "master would wait for a lost worker); use train.algorithm=allreduce or local_sgd")
    if t["backend"] != "mpi":
        raise UsageError(f"search.elastic needs train.backend=mpi (ULFM), not {t['backend']}")


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


class BlockWatch:
    """An any-source receive posted on the block's communicator, that no rank ever sends:
    MPI completes it with an error once a rank of the block is lost, or the block revoked.
    :meth:`check`, after every step, raises that error, so that a fold's ranks leave a trial
    that another fold of their block lost at the end of the step in which MPI tells them."""

    TAG = 0x5EA  # never sent

    def __init__(self, block_comm):
        MPI = mcomm.mpi()
        self._buf = bytearray(1)
        self.request = block_comm.Irecv([self._buf, MPI.BYTE], source=MPI.ANY_SOURCE,
                                        tag=self.TAG)

    def check(self) -> None:
        self.request.Test()  # MPI.Exception for a lost rank or a revoked block

    def close(self) -> None:
        try:
            self.request.Cancel()
            self.request.Wait()
        except mcomm.mpi().Exception:  # already completed with the loss
            pass


def retire(world, block_comms, block: int, hosts, tag: int) -> None:
    """A block rank that saw a failure: revoke the block's communicators (the others leave
    what they wait in), shrink the block (collective over its survivors: each one has left
    its trial), and the first survivor tells the coordinator (a ``tag`` message) which ranks
    were lost, unless the coordinator is the one lost (then the end's shrink says so)."""
    MPI = mcomm.mpi()
    for c in block_comms:
        try:
            c.Revoke()
        except MPI.Exception:  # revoked already by a block-mate
            pass
    block_comm = block_comms[0]
    try:
        shrunk = block_comm.Shrink()
    except MPI.Exception:  # (a shrink tolerates losses; nothing else is left to say)
        return
    try:
        if shrunk.Get_rank() != 0 or 0 in failed_ranks(world):
            return
        gone = MPI.Group.Difference(block_comm.Get_group(), shrunk.Get_group())
        lost = sorted(MPI.Group.Translate_ranks(gone, list(range(gone.Get_size())),
                                                world.Get_group()))
        world.send({"block": block, "retired": True,
                    "lost": describe(lost, hosts) if lost else "a rank of the block lost"},
                   dest=0, tag=tag)
    except MPI.Exception:  # the coordinator went meanwhile: the end's shrink says so
        pass
    finally:
        shrunk.Free()


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
