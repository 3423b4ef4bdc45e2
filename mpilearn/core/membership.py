"""Who is in the job: the one place that notices a lost rank and makes the survivors a new
communicator (Open MPI 5's ULFM: ``mpirun --with-ft ulfm``).

Everything that holds the job's communicator registers here (:meth:`Membership.on_change`);
after a loss, :meth:`Membership.recover` revokes the old communicator (so that every survivor
leaves whatever collective it was in), shrinks it to the survivors, agrees on a value (the
last step every survivor applied) and hands the new communicator to every holder. The driver,
the Horovod elastic API and the sweep's blocks call this module; none of them talks to ULFM.

Growth is the other direction (:meth:`Membership.grow`): the ranks spawn new ones
(``MPI_Comm_spawn`` of the job's own command), merge the intercommunicator with the newcomers
after them, and hand the merged communicator to the same holders; a newcomer finds its way in
with :func:`joined`.

Measured here (Open MPI 5.0.11, np=3): survivors see MPI_ERR_PROC_FAILED 7-16 ms after a
``kill -9``; revoke + shrink + agree took about 1 ms. Spawn + merge of one rank: 1.2-1.6 s.
"""
from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

from . import comm as mcomm

from ..errors import BELOW_MIN_EXIT, BelowMinRanks, LostBeforeTraining  # noqa: F401

# what a survivor with nothing in memory to go back to offers in the agreement on the step
# (it is in start-up, or past its last epoch): the smallest value, so every survivor learns it
NO_SNAPSHOT = -1


class RanksLost(RuntimeError):
    """The survivors of a loss rebuilt their communicator; what was in flight is void."""

    def __init__(self, change: "Change"):
        super().__init__(change.describe())
        self.change = change


class TooFewRanks(BelowMinRanks):
    """Fewer ranks than ``min_ranks`` are left (the survivors checkpoint and exit 75)."""

    def __init__(self, change: "Change", min_ranks: int, step: int):
        super().__init__(f"{change.describe()}: fewer than train.elastic.min_ranks={min_ranks}; "
                         f"checkpoint of step {step} written")
        self.change, self.min_ranks = change, min_ranks


class Growing(Exception):
    """Every rank agreed, at one step boundary, to grow to ``ranks`` (``hosts``: where the
    new ones may go, ``host:slots,...``); ``reason``: the launcher's words."""

    def __init__(self, ranks: int, hosts: str, reason: str):
        super().__init__(reason)
        self.ranks, self.hosts, self.reason = ranks, hosts, reason


@dataclass
class Change:
    """One membership change, as the survivors agreed on it."""

    lost: List[tuple]          # (old rank, host) of every lost rank
    old_size: int
    new_size: int
    old_rank: int              # this process, before and after
    new_rank: int
    leader_lost: bool          # old rank 0 is among the lost: rank 0's duties move
    seconds: float = 0.0       # revoke + shrink + agree (a growth: spawn + merge)
    detected: float = field(default_factory=time.time)
    added: List[tuple] = field(default_factory=list)  # (new rank, host) of every spawned rank

    def who(self) -> str:
        return ", ".join(f"rank {r}" + (f" on {h}" if h else "") for r, h in self.lost) or \
            "no rank"

    def describe(self) -> str:
        if self.added:
            who = ", ".join(f"rank {r} on {h}" for r, h in self.added)
            return f"spawned {who}; {self.old_size} -> {self.new_size} ranks"
        return f"lost {self.who()}; {self.old_size} -> {self.new_size} ranks"

    def record(self) -> dict:
        if self.added:
            return {"added_ranks": [r for r, _ in self.added],
                    "added_hosts": [h for _, h in self.added], "old_size": self.old_size,
                    "ranks": self.new_size, "spawned": True, "spawn_s": round(self.seconds, 4)}
        return {"lost_ranks": [r for r, _ in self.lost], "lost_hosts": [h for _, h in self.lost],
                "old_size": self.old_size, "ranks": self.new_size,
                "leader_lost": self.leader_lost, "recovery_s": round(self.seconds, 4),
                "detected_at": round(self.detected, 4)}


def failure_classes() -> tuple:
    MPI = mcomm.mpi()
    return tuple(getattr(MPI, n) for n in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING",
                                           "ERR_REVOKED") if hasattr(MPI, n))


def is_failure(err: BaseException) -> bool:
    """Whether ``err`` is MPI's report of a lost process (or of a revoked communicator)."""
    MPI = mcomm.mpi()
    if not isinstance(err, MPI.Exception):
        return False
    try:
        return err.Get_error_class() in failure_classes()
    except Exception:  # an error code without a class
        return False


def supported() -> bool:
    MPI = mcomm.mpi()
    return all(hasattr(MPI.Comm, n) for n in ("Revoke", "Shrink", "Agree"))


class Membership:
    """The job's live communicator and the hosts of its ranks."""

    def __init__(self, comm, min_ranks: int = 1, max_ranks: int = 0, gather: bool = True):
        MPI = mcomm.mpi()
        comm.Set_errhandler(MPI.ERRORS_RETURN)  # a loss raises MPI.Exception instead of aborting
        self.comm, self.min_ranks, self.max_ranks = comm, min_ranks, max_ranks
        # the ranks' hosts: a collective, left for later by a membership made before any
        # (:meth:`early`; until then a lost rank is named without its host)
        self.hosts = comm.allgather(socket.gethostname()) if gather else \
            [None] * comm.Get_size()
        self.changes: List[Change] = []
        self._listeners: List[Callable] = []
        # where this rank is: a loss outside the training loop ends the job (exit 75)
        self.phase = "start-up"

    @classmethod
    def for_context(cls, ctx, min_ranks: int = 1, max_ranks: int = 0) -> "Membership":
        """The job's membership over ``ctx``'s communicator, which follows every change (and
        the node-local split and exit barrier with it); made current."""
        m = cls(ctx.comm, min_ranks, max_ranks)
        m.follow(ctx)
        set_current(m)
        return m

    def follow(self, ctx) -> None:
        """``ctx``'s communicator follows every change (and the node-local split and exit
        barrier with it)."""
        self.on_change(lambda new, change: mcomm.replace_comm(ctx, new,
                                                              shrunk=not change.added))

    @classmethod
    def early(cls, comm) -> "Membership":
        """Right after ``MPI_Init`` (under ULFM), before any collective: a rank lost in the rest
        of start-up (the node-local split, the config, the launcher check) is then named and
        ends the job with one line and exit 75 (:func:`outside_training`), not a traceback.
        Made current; ``train``'s main gathers the hosts once its context exists, and the
        bounds follow once the config is read (``train/elastic.join``)."""
        m = cls(comm, gather=False)
        set_current(m)
        return m

    def gather_hosts(self) -> None:
        """Collective: every rank's host (a lost rank is named with it)."""
        self.hosts = self.comm.allgather(socket.gethostname())

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    @property
    def size(self) -> int:
        return self.comm.Get_size()

    def on_change(self, fn: Callable) -> None:
        """``fn(new_comm, change)`` after every change (whoever holds the communicator)."""
        self._listeners.append(fn)

    def base(self) -> tuple:
        """Who is in the job now: what a recovery's change is measured from (a recovery that
        a second loss interrupted starts again from the same base, so that its one change
        names every rank lost since)."""
        return self.comm.Get_group(), list(self.hosts), self.comm.Get_rank()

    def recover(self, detected: Optional[float] = None, base: Optional[tuple] = None,
                start: Optional[float] = None) -> Change:
        """Collective over the survivors (each calls it once it saw a failure): revoke, shrink,
        and hand every holder the new communicator. A failure during the shrink itself (a second
        rank lost meanwhile) is absorbed by MPI_Comm_shrink, which excludes it too; one after
        it is :func:`recover_then`'s. ``base``: :meth:`base` before the first attempt, ``start``
        its ``time.perf_counter()`` (the change's seconds count from there)."""
        MPI = mcomm.mpi()
        start = start or time.perf_counter()
        old = self.comm
        group, hosts, old_rank = base or self.base()
        try:
            old.Revoke()
        except MPI.Exception:  # already revoked by another survivor
            pass
        new = old.Shrink()
        new.Set_errhandler(MPI.ERRORS_RETURN)
        kept = MPI.Group.Translate_ranks(new.Get_group(), list(range(new.Get_size())), group)
        lost = sorted(set(range(group.Get_size())) - set(kept))
        change = Change(lost=[(r, hosts[r]) for r in lost], old_size=group.Get_size(),
                        new_size=new.Get_size(), old_rank=old_rank, new_rank=new.Get_rank(),
                        leader_lost=0 in lost, detected=detected or time.time())
        self.hosts = [hosts[r] for r in kept]
        self.comm = new
        for fn in self._listeners:
            fn(new, change)
        change.seconds = time.perf_counter() - start
        self.changes.append(change)
        return change

    def grow(self, merged, newcomer: bool = False, started: Optional[float] = None) -> Change:
        """Collective over the merged communicator (the ranks before, then the newcomers that
        :func:`spawn` started, ``newcomer``): every holder follows it. ``Change.added`` names
        the newcomers; ``seconds``: since ``started`` (a perf_counter) until all are here."""
        MPI = mcomm.mpi()
        merged.Set_errhandler(MPI.ERRORS_RETURN)
        old_size = allreduce_int(merged, 0 if newcomer else 1)
        seconds = time.perf_counter() - started if started is not None else 0.0
        old_rank = -1 if newcomer else self.comm.Get_rank()
        self.hosts = merged.allgather(socket.gethostname())
        self.comm = merged
        change = Change(lost=[], old_size=old_size, new_size=merged.Get_size(),
                        old_rank=old_rank, new_rank=merged.Get_rank(), leader_lost=False,
                        seconds=seconds, added=[(r, self.hosts[r]) for r in
                                                range(old_size, merged.Get_size())])
        for fn in self._listeners:
            fn(merged, change)
        self.changes.append(change)
        return change

    def agree_min(self, value: int) -> int:
        """Collective on the new communicator: the smallest ``value`` of the survivors (the last
        step every survivor applied). A rank lost meanwhile surfaces as MPI.Exception."""
        return allreduce_int(self.comm, value, mcomm.mpi().MIN)


def allreduce_int(comm, value: int, op=None) -> int:
    """``comm.allreduce(value, op)`` of one int through a buffer: mpi4py's object allreduce
    holds the GIL while it waits (4.1, measured), so no other thread of the rank, the
    watchdog's included, would run until a late or hung peer arrives."""
    import numpy as np

    buf = np.array([int(value)], dtype=np.int64)
    comm.Allreduce(mcomm.mpi().IN_PLACE, buf, op=op or mcomm.mpi().SUM)
    return int(buf[0])


def lost_beneath(comm) -> bool:
    """Whether ``comm`` knows a failed process or was revoked (local calls): then an error of
    another type is a loss too. TensorFlow turns an exception inside a graph's collective (a
    ``py_function``: the compiled Keras steps' allreduce) into its own UnknownError."""
    try:  # (the group is left unfreed: this runs once per error, on the way out or to recover)
        return comm.Get_failed().Get_size() > 0 or comm.Is_revoked()
    except Exception:  # noqa: BLE001 - an MPI without these calls: no loss known
        return False


def lost(err: BaseException, comm=None) -> bool:
    """Whether ``err`` says that ranks were lost (MPI's report, or :class:`RanksLost`), or
    ``comm`` knows of a loss beneath another error (:func:`lost_beneath`)."""
    return is_failure(err) or isinstance(err, RanksLost) or \
        (comm is not None and lost_beneath(comm))


def recover_then(membership: Membership, on_loss: Callable[[Change], object],
                 detected: Optional[float] = None):
    """:meth:`Membership.recover`, then ``on_loss(change)`` (agree, restore) on the new
    communicator; returns what ``on_loss`` returns. A rank lost while either runs (its
    collectives raise) starts the recovery again with the smaller set, from the same base:
    the change ``on_loss`` finally sees names every rank lost since the first failure, and it
    is the one recorded. Below ``min_ranks`` is ``on_loss``'s to decide (TooFewRanks)."""
    base, detected = membership.base(), detected or time.time()
    start, before = time.perf_counter(), len(membership.changes)
    while True:
        try:
            change = membership.recover(detected, base, start)
            return on_loss(change)
        except Exception as err:  # noqa: BLE001 - only MPI's loss reports are retried
            if not lost(err, membership.comm):
                raise
        finally:  # an interrupted attempt's change is part of the next one's
            membership.changes[before:] = membership.changes[before:][-1:]


def run_guarded(membership: Membership, fn: Callable, on_loss: Callable[[Change], None],
                on_growth: Optional[Callable[[Growing], None]] = None):
    """``fn()``, and after every loss of ranks ``on_loss(change)`` then ``fn()`` again: the loop
    every elastic caller (the driver, ``hvd.elastic.run``) shares. Errors other than a lost
    process propagate; so does :class:`TooFewRanks` (raised by ``on_loss``). A
    :class:`Growing` raised by ``fn`` is ``on_growth``'s, then ``fn()`` goes on."""
    while True:
        try:
            return fn()
        except Growing as growing:
            if on_growth is None:
                raise
            on_growth(growing)
            continue
        except Exception as err:  # noqa: BLE001 - only MPI's loss reports are handled
            if not lost(err, membership.comm):
                raise
            detected = time.time()
        recover_then(membership, on_loss, detected)


def outside_training(membership: Membership, err: BaseException) -> BaseException:
    """What ``err`` ends the job with where no snapshot covers it: a lost rank in start-up
    (before the first snapshot) or after the last epoch becomes :class:`LostBeforeTraining`
    (one line, exit 75), once the survivors agreed on who is lost; any other error is
    returned as it is. Collective over the survivors: a survivor that is already in the
    training loop learns it from the agreement (:data:`NO_SNAPSHOT`) and ends too."""
    if not lost(err, membership.comm):
        return err
    change = recover_then(membership, lambda c: (membership.agree_min(NO_SNAPSHOT), c)[1])
    return before_training(change, membership.phase)


def before_training(change: Change, phase: str) -> LostBeforeTraining:
    """The one line of a loss that no snapshot covers (``phase``: where this rank was)."""
    what = ("nothing trained was lost" if phase != "training" else
            "what was trained since the newest checkpoint is lost")
    err = LostBeforeTraining(f"lost {change.who()} during {phase} ({change.old_size} -> "
                             f"{change.new_size} ranks); {what}: run it again with "
                             "--resume auto")
    err.phase = phase
    return err


# the MPI runtime's own variables: a newcomer gets its own from the launcher's daemon
RUNTIME_PREFIXES = ("OMPI_", "PMIX_", "PRTE_", "OPAL_")


def spawn(comm, count: int, command: List[str], hosts: str = ""):
    """Collective over ``comm``: ``count`` new processes of ``command``, merged after the
    ranks of ``comm``; the merged intracommunicator. Raises MPI.Exception where the launcher
    cannot (no free slot, no PMIx server). ``hosts``: ``host:slots,...`` the newcomers may
    use, added to the launcher's allocation (Open MPI 5's ``PMIX_ADD_HOST``).

    The newcomers get this process's environment (less the MPI runtime's own variables)
    through ``env``: a spawned process gets only the launcher daemon's, and MPI_Info values
    stop at 256 characters. The intercommunicator is disconnected at once: a job that kept
    it connected crashed in MPI_Finalize (Open MPI 5.0.11) where a newcomer had not talked
    with every parent yet."""
    MPI = mcomm.mpi()
    info = MPI.Info.Create()
    if hosts:
        info.Set("PMIX_ADD_HOST", hosts)
    info.Set("bind-to", "none")  # as mpilearn-run launches the first ranks
    env = [f"{k}={v}" for k, v in os.environ.items() if not k.startswith(RUNTIME_PREFIXES)]
    try:
        inter = comm.Spawn("/usr/bin/env", env + list(command), maxprocs=count, info=info,
                           root=0)
    finally:
        info.Free()
    merged = inter.Merge(high=False)
    inter.Disconnect()
    return merged


def joined():
    """In a process that :func:`spawn` started: the merged communicator (its parents
    first); None in a process that a launcher started."""
    MPI = mcomm.mpi()
    global _SPAWNED
    parent = MPI.Comm.Get_parent()
    if parent == MPI.COMM_NULL:
        return None
    merged = parent.Merge(high=True)
    parent.Disconnect()
    _SPAWNED = True
    return merged


_SPAWNED = False


def spawned() -> bool:
    """Whether this process joined a running job (:func:`joined`), not started with it."""
    return _SPAWNED


def spawned_command() -> List[str]:
    """This process's own command line (``python -m mpilearn.train ...``): what the
    newcomers run."""
    return [sys.executable, *getattr(sys, "orig_argv", [sys.executable, *sys.argv])[1:]]


_CURRENT: Optional[Membership] = None


def current() -> Optional[Membership]:
    """The job's membership once an elastic run set one up (None otherwise)."""
    return _CURRENT


def set_current(m: Optional[Membership]) -> None:
    global _CURRENT
    _CURRENT = m
