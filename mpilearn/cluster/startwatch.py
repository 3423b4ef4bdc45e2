"""``mpilearn-run``'s view of its job's start-up: which of its ranks run on this machine (the
launcher's children, by the rank in their environment), where each one is (the ``phase``
records it writes in the job's status file: ``core/startup.py``), and the ranks it saw die.

Under ULFM a rank lost before it joined ``MPI_Init`` leaves the others waiting there for ever
(``core/startup.py`` says why); the ranks' own watchers end such a job after
``MPILEARN_START_TIMEOUT`` seconds. A rank of this machine that dies during start-up is seen
here at once: :meth:`StartWatch.lost_in_start_up` gives the line that ends the job, once the
survivors had :data:`LOSS_GRACE` seconds to end it themselves (past ``MPI_Init`` they do, with
their own line). :meth:`StartWatch.starting` says which ranks are still starting, for a stop
signal that the ranks cannot hear while they wait in ``MPI_Init``.

Ranks on other machines are not seen: for them the ranks' bound holds. Only ranks that record
their phases take part (``python -m mpilearn.train`` and ``refit``); a sweep's or a script's
ranks are left to the launcher and themselves, as before.
"""
from __future__ import annotations

import os
import socket
import time
from typing import Dict, List, Optional, Tuple

from ..core import startup

LOSS_GRACE = 3.0  # seconds the survivors of a start-up loss have to end the job themselves
RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMI_RANK")  # Open MPI, Hydra (MPICH, Intel MPI)


def children(pid: int) -> List[int]:
    """The child processes of ``pid`` (Linux: every thread's ``children`` list)."""
    out: List[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(p) for p in f.read().split()]
        except (OSError, ValueError):
            continue
    return out


def descendants(pid: int) -> List[int]:
    """Every process below ``pid`` (its children, theirs, ...)."""
    out, todo = [], children(pid)
    while todo:
        out += todo
        todo = [c for p in todo for c in children(p)]
    return out


def rank_of(pid: int) -> Optional[int]:
    """The MPI rank in ``pid``'s environment (None: not a rank, not yet, or spawned later by
    the job: those are the job's to count, not its start-up's)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    except OSError:
        return None
    if b"OMPI_PARENT_PORT" in env:
        return None
    for name in RANK_VARIABLES:
        value = env.get(name.encode())
        if value is not None and value.isdigit():
            return int(value)
    return None


def phases(path: str) -> Dict[int, Tuple[int, str]]:
    """Every rank's last ``phase`` record in the status file: {rank: (pid, phase)}."""
    out: Dict[int, Tuple[int, str]] = {}
    try:
        with open(path) as f:
            for line in f:
                fields = line.split(" ", 3)
                if len(fields) == 4 and fields[0] == "phase" and fields[1].isdigit() \
                        and fields[2].isdigit():
                    out[int(fields[1])] = (int(fields[2]), fields[3].strip())
    except OSError:
        pass
    return out


def phase_words(phase: Optional[str]) -> str:
    """Where a rank was, as the lines say it."""
    return phase or "its interpreter's start, before mpilearn ran"


class StartWatch:
    """Polled by ``cluster/run.launch`` with the launcher's pid and the job's status file."""

    def __init__(self, launcher_pid: int, status: str, local_ranks: int = 0,
                 grace: float = LOSS_GRACE):
        """``local_ranks``: how many ranks the launcher starts on this machine where it starts
        them all here (else 0): one never seen alive (killed as its interpreter started,
        between two polls) is then counted gone once its peers have run ``UNSEEN`` s."""
        self.launcher_pid, self.status, self.grace = launcher_pid, status, grace
        self.expected = set(range(local_ranks))
        self.ranks: Dict[int, int] = {}       # pid -> rank, this machine's
        self.gone: Dict[int, float] = {}      # rank -> when it was seen gone
        self.records: Dict[int, Tuple[int, str]] = {}
        self.first_seen: Optional[float] = None
        self._size = -1

    UNSEEN = 2.0  # the launcher starts a machine's ranks within milliseconds of each other

    def poll(self) -> None:
        try:
            size = os.path.getsize(self.status)
        except OSError:
            size = self._size
        if size != self._size:
            self._size, self.records = size, phases(self.status)
        if self.over():
            return
        live = set()
        for pid in children(self.launcher_pid):
            # Open MPI's ranks are its children, Hydra's its proxy's (a rank's own children,
            # its start-up watcher among them, carry its rank too: not counted)
            rank = self._rank(pid)
            for proc, rank in ([(pid, rank)] if rank is not None else
                               [(p, self._rank(p)) for p in children(pid)]):
                live.add(proc)
                if rank is not None:
                    self.ranks[proc] = rank
        now = time.monotonic()
        if self.ranks and self.first_seen is None:
            self.first_seen = now
        for pid, rank in self.ranks.items():
            if pid not in live and rank not in self.gone:
                self.gone[rank] = now
        if self.first_seen is not None and now - self.first_seen > self.UNSEEN:
            for rank in self.expected - set(self.ranks.values()) - set(self.gone):
                self.gone[rank] = now

    def _rank(self, pid: int) -> Optional[int]:
        return self.ranks[pid] if pid in self.ranks else rank_of(pid)

    def over(self) -> bool:
        """Every rank of this machine has started (or left), and none was lost before: from
        here a loss is the ranks' to survive, and a stop their own to act on."""
        if not self.ranks or set(self.expected) - set(self.ranks.values()):
            return False
        return all(self.phase(rank) in (startup.STARTED, startup.LEAVING)
                   for rank in self.ranks.values())

    def phase(self, rank: int) -> Optional[str]:
        record = self.records.get(rank)
        return record[1] if record else None

    def during(self, rank: int) -> Optional[str]:
        """``rank``'s start-up phase in words, or None where it had started (or is unknown)."""
        if rank not in self.records:
            return None
        phase = self.phase(rank)
        return None if phase in (startup.STARTED, startup.LEAVING) else phase_words(phase)

    def lost_in_start_up(self, aborted=lambda: ()) -> Optional[Tuple[int, str]]:
        """(rank, phase words) of a rank of this machine that died during start-up: not
        started, not leaving with its status decided, not an abort (``aborted()``: the ranks
        that recorded one, which ends the job by itself). At once where every rank seen here
        still waits in ``MPI_Init`` (for it); else ``grace`` seconds later (past ``MPI_Init``
        the survivors see the loss themselves). None otherwise."""
        if not self.records:  # not ranks that say where they are (a sweep's, a script's)
            return None
        now = time.monotonic()
        waiting = {rank for rank, _ in self.starting()} and all(
            self.phase(rank) == startup.MPI_INIT for rank, _ in self.starting())
        for rank, when in sorted(self.gone.items(), key=lambda item: item[1]):
            phase = self.phase(rank)
            if phase in (startup.STARTED, startup.LEAVING) or \
                    now - when < (self.SETTLE if waiting else self.grace):
                continue
            if rank not in aborted():
                return rank, phase_words(phase)
        return None

    SETTLE = 0.5  # a rank lost as the others' MPI_Init ends: they record the next phase

    def starting(self) -> List[Tuple[int, str]]:
        """(rank, phase words) of the ranks of this machine that are alive and not started
        (none where no rank records its phases: a sweep's, a script's)."""
        if not self.records:
            return []
        gone = set(self.gone)
        return [(rank, phase_words(self.phase(rank))) for rank in sorted(self.ranks.values())
                if rank not in gone and self.phase(rank) not in (startup.STARTED,
                                                                 startup.LEAVING)]

    def local_pids(self) -> List[int]:
        gone = set(self.gone)
        return [pid for pid, rank in self.ranks.items() if rank not in gone]


def host() -> str:
    return socket.gethostname()
