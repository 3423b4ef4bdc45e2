"""Life cycle, queries and process sets of the Horovod-shaped API (``horovod.torch`` 0.28).

A Horovod process set is an MPI sub-communicator here. Each set holds three duplicates of its
communicator, so that the three kinds of traffic never match each other's messages:
``meta`` (the per-collective metadata exchange that detects mismatches), ``data`` (the
collectives themselves) and ``sync`` (barriers and the fused gradient reducer's traffic stays
on the set's own ``comm``).
"""
from __future__ import annotations

import atexit
from typing import Dict, List, Optional, Sequence, Union

from ..core import comm as _comm

NOT_INITIALIZED = "Horovod has not been initialized; use hvd.init()."


class SetState:
    """The communicators and queue of one process set (or of any communicator passed as
    ``comm=``), on a rank that belongs to it."""

    def __init__(self, comm, global_ranks: List[int]):
        self.comm = comm                  # the fused gradient reducer's traffic
        self.meta = comm.Dup()
        self.data = comm.Dup()
        self.aux = comm.Dup()             # alltoall split counts
        self.sync = comm.Dup()
        self.ranks = global_ranks         # set rank -> global rank
        self.queue: list = []             # submitted, unfinished operations, in order
        self.pending_names: Dict[str, object] = {}
        self.rounds = 0                   # metadata rounds so far (the same on every member)
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def free(self) -> None:
        for c in (self.meta, self.data, self.aux, self.sync):
            c.Free()


class _World:
    """Everything ``init`` sets up; ``None`` until then."""

    def __init__(self, ctx, cross):
        self.ctx = ctx
        self.cross = cross
        self.homogeneous = len(set(ctx.comm.allgather(ctx.local_size))) == 1
        self.sets: Dict[int, Optional[SetState]] = {}   # id -> state (None: not a member)
        self.set_ranks: Dict[int, tuple] = {}
        self.next_id = 1


_WORLD: Optional[_World] = None


def _is_iterable(x) -> bool:
    try:
        iter(x)
        return True
    except TypeError:
        return False


class ProcessSet:
    """A subset of the ranks that runs collectives together (Horovod's class): build it from
    a list of global ranks or an mpi4py communicator, then pass it to ``init(process_sets=)``
    or :func:`add_process_set`."""

    process_set_id = None
    ranks = None
    mpi_comm = None

    def __init__(self, ranks_or_comm):
        if _is_iterable(ranks_or_comm):
            ranks = sorted(ranks_or_comm)
            if any(not isinstance(r, int) for r in ranks):
                raise ValueError("ProcessSet should be initialized with a list of process ranks "
                                 "or an mpi4py Comm object")
            self.ranks = ranks
        else:
            if not isinstance(ranks_or_comm, _comm.mpi().Comm):
                raise ValueError("ProcessSet should be initialized with a list of process ranks "
                                 "or an mpi4py Comm object")
            self.mpi_comm = ranks_or_comm

    def _invalidate(self) -> None:
        self.process_set_id = None

    def size(self) -> Optional[int]:
        if self.process_set_id is None:
            return None
        return len(_world().set_ranks[self.process_set_id])

    def rank(self) -> Optional[int]:
        """This process's rank inside the set (None before init, -1 when not a member)."""
        if self.process_set_id is None:
            return None
        state = _world().sets[self.process_set_id]
        return state.rank if state is not None else -1

    def included(self) -> Optional[bool]:
        if self.ranks is None:
            return None
        return rank() in self.ranks

    def __str__(self) -> str:
        return (f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, "
                f"mpi_comm={self.mpi_comm})")

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def _world() -> _World:
    if _WORLD is None:
        raise ValueError(NOT_INITIALIZED)
    return _WORLD


def init(comm=None, process_sets=None):
    """Initialise (idempotent). ``comm``: None (COMM_WORLD), an mpi4py communicator, or a list
    of COMM_WORLD ranks. ``process_sets``: ProcessSet objects to set up now, or "dynamic"."""
    global _WORLD
    MPI = _comm.mpi()
    if comm is not None and not isinstance(comm, MPI.Comm):
        if not _is_iterable(comm):
            raise ValueError("Invalid type of argument comm. Expected list of rank integers or "
                             "mpi4py.MPI.Comm object.")
        ranks = sorted(comm)
        member = MPI.COMM_WORLD.Get_rank() in ranks
        comm = MPI.COMM_WORLD.Split(0 if member else MPI.UNDEFINED, MPI.COMM_WORLD.Get_rank())
        if not member:
            raise ValueError(f"rank {MPI.COMM_WORLD.Get_rank()} is not in hvd.init(comm={ranks})")
    if process_sets is None or (isinstance(process_sets, str) and process_sets.lower() == "dynamic"):
        process_sets = []
    if _WORLD is None or (comm is not None and comm is not _WORLD.ctx.comm):
        ctx = _comm.init(comm)
        if comm is None:
            from ..cluster.launcher import detect, mismatch

            problem = mismatch(detect(), ctx.size)
            if problem is not None:
                raise ValueError(problem)
        cross = ctx.comm.Split(ctx.local_rank, ctx.rank)
        if _WORLD is not None:
            shutdown()
        _WORLD = _World(ctx, cross)
        _WORLD.sets[0] = SetState(ctx.comm, list(range(ctx.size)))
        _WORLD.set_ranks[0] = tuple(range(ctx.size))
        global_process_set.ranks = list(range(ctx.size))
        global_process_set.mpi_comm = ctx.comm
        global_process_set.process_set_id = 0
        atexit.register(shutdown)
    for i, ps in enumerate(process_sets):
        if not isinstance(ps, ProcessSet):
            raise ValueError(f"process_sets entry number {i} is not a ProcessSet: {ps!r}")
        if ps.ranks is None:
            ps.ranks = sorted(_WORLD.ctx.comm.allgather(rank() if ps.mpi_comm != MPI.COMM_NULL
                                                        else None))
            ps.ranks = [r for r in ps.ranks if r is not None]
        existing = _find(ps.ranks)
        if existing is not None:
            if existing == 0 or any(p is not ps and p.process_set_id == existing
                                    for p in process_sets[:i]):
                ps._invalidate()
                raise ValueError(f"Horovod could not be initialized because process_sets entry "
                                 f"number {i} is a duplicate: {ps}")
            ps.process_set_id = existing
            continue
        _register(ps)
    return _WORLD.ctx


def reinit(ctx) -> None:
    """The world becomes ``ctx.comm`` (the survivors of a lost rank: ``hvd.elastic``); the old
    world's communicators are dropped, not freed (they hold a dead rank), and so are process
    sets other than the global one."""
    global _WORLD
    MPI = _comm.mpi()
    cross = ctx.comm.Split(ctx.local_rank, ctx.rank)
    _WORLD = _World(ctx, cross)
    state = _WORLD.sets[0] = SetState(ctx.comm, list(range(ctx.size)))
    for c in (state.meta, state.data, state.aux, state.sync, cross):
        c.Set_errhandler(MPI.ERRORS_RETURN)
    _WORLD.set_ranks[0] = tuple(range(ctx.size))
    global_process_set.ranks = list(range(ctx.size))
    global_process_set.mpi_comm = ctx.comm
    _BY_COMM.clear()


def _find(ranks) -> Optional[int]:
    for i, r in _world().set_ranks.items():
        if list(r) == list(ranks):
            return i
    return None


def _register(ps: ProcessSet) -> ProcessSet:
    """Collective over all ranks: a sub-communicator for ``ps.ranks``."""
    MPI = _comm.mpi()
    w = _world()
    bad = [r for r in ps.ranks if not 0 <= r < w.ctx.size]
    if bad or len(set(ps.ranks)) != len(ps.ranks) or not ps.ranks:
        raise ValueError(f"invalid ranks for a process set of a world of {w.ctx.size}: {ps.ranks}")
    member = w.ctx.rank in ps.ranks
    sub = w.ctx.comm.Split(0 if member else MPI.UNDEFINED, ps.ranks.index(w.ctx.rank) if member else 0)
    ps.process_set_id = w.next_id
    w.next_id += 1
    w.sets[ps.process_set_id] = SetState(sub, list(ps.ranks)) if member else None
    w.set_ranks[ps.process_set_id] = tuple(ps.ranks)
    if ps.mpi_comm is None and member:
        ps.mpi_comm = sub
    return ps


def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Add a process set after init (collective: every rank calls it with the same ranks)."""
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.ranks is None:
        raise NotImplementedError("Dynamically adding process sets defined by an MPI communicator "
                                  "is not implemented. Please build the process set via a list of "
                                  "ranks.")
    if _find(process_set.ranks) is not None:
        raise ValueError(f"Attempted to add a duplicate process set: {process_set}")
    return _register(process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Remove a process set (collective); False for the global set or an unknown one."""
    w = _world()
    pid = process_set.process_set_id
    if pid is None or pid == 0 or pid not in w.sets:
        return False
    state = w.sets.pop(pid)
    w.set_ranks.pop(pid)
    if state is not None:
        state.free()
        state.comm.Free()
    process_set._invalidate()
    return True


def state_of(process_set: ProcessSet = global_process_set, comm=None) -> SetState:
    """The member state for a process set, or for an explicit communicator (mpilearn's
    ``comm=`` keyword, so that the same calls work inside an HPO block without init)."""
    if comm is not None:
        # keyed by the object, which the state keeps alive so that the key is not reused;
        # ranks (root_rank, ...) are the communicator's own, unlike a process set's global ones
        key = id(comm)
        if key not in _BY_COMM:
            _BY_COMM[key] = SetState(comm, list(range(comm.Get_size())))
        return _BY_COMM[key]
    w = _world()
    pid = (process_set or global_process_set).process_set_id
    if pid is None or pid not in w.sets:
        raise ValueError(f"{process_set} has not been initialized or was removed")
    state = w.sets[pid]
    if state is None:
        raise ValueError(f"Rank {rank()} is not a member of the provided process set.")
    return state


_BY_COMM: Dict[int, SetState] = {}   # states of explicit comm= arguments


def shutdown() -> None:
    global _WORLD
    if _WORLD is None:
        return
    w, _WORLD = _WORLD, None
    try:
        if _comm.mpi().Is_finalized():
            return
        for pid, state in list(w.sets.items()):
            if state is not None:
                state.free()
                if pid != 0:
                    state.comm.Free()
        w.cross.Free()
    except Exception:  # shutting down: MPI may already be going away
        pass
    for ps in (global_process_set,):
        ps.ranks = []


def is_initialized() -> bool:
    return _WORLD is not None


def rank() -> int:
    return _world().ctx.rank


def size() -> int:
    return _world().ctx.size


def local_rank() -> int:
    return _world().ctx.local_rank


def local_size() -> int:
    return _world().ctx.local_size


def cross_rank() -> int:
    return _world().cross.Get_rank()


def cross_size() -> int:
    return _world().cross.Get_size()


def is_homogeneous() -> bool:
    return _world().homogeneous


def mpi_threads_supported() -> bool:
    _world()
    MPI = _comm.mpi()
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_enabled() -> bool:
    return True


def mpi_built() -> bool:
    return True


def gloo_enabled() -> bool:
    return False


def gloo_built() -> bool:
    return False


def nccl_built() -> int:
    """Like Horovod: the NCCL version code when NCCL is usable (through the ``torch``
    gradient backend), else 0."""
    import torch

    if not (torch.cuda.is_available() and torch.distributed.is_available()
            and torch.distributed.is_nccl_available()):
        return 0
    major, minor, patch = torch.cuda.nccl.version()
    return major * 10000 + minor * 100 + patch


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    import torch

    return torch.version.cuda is not None


def rocm_built() -> bool:
    import torch

    return getattr(torch.version, "hip", None) is not None


def start_timeline(file_path, mark_cycles=False) -> None:
    """Horovod's timeline: rank 0 writes a Chrome trace of every collective's negotiation
    and data phases to ``file_path`` until :func:`stop_timeline`."""
    from . import timeline

    timeline.start(file_path, mark_cycles, rank() == 0)


def stop_timeline() -> None:
    from . import timeline

    timeline.stop()
