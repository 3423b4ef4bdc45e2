"""A rank's start-up, from the interpreter's start until the job's ranks know each other: the
phases it goes through, recorded for ``mpilearn-run``, and the bound on the one wait that no
rank can leave by itself.

Why (issue 57). Under ULFM (``mpirun --with-ft ulfm``, what ``mpilearn-run --min-np`` uses
with Open MPI 5) the launcher keeps a job running after one of its processes dies, and MPI
reports the loss to the others only once ``MPI_Init`` has returned. ``MPI_Init`` itself ends
with an exchange (a PMIx fence) that waits for every process of the job: a rank lost before it
joined that exchange (``kill -9`` while it imports, a node that fails, the OOM killer) left the
others waiting in it for ever (14 minutes, then killed by hand; without ULFM the launcher ends
the job at once). mpi4py holds the interpreter's lock during ``MPI_Init``, so no thread of the
rank can act, and a stop signal's handler never runs.

So, where ULFM is on (``OMPI_MCA_mpi_ft_enable``, which ``mpirun --with-ft ulfm`` sets), the
rank ends itself when its ``MPI_Init`` has not returned ``MPILEARN_START_TIMEOUT`` seconds
(default 120; ``mpilearn-run --start-timeout``; 0: no bound) after it began (:func:`arm`): a
watcher process forked before MPI starts says so in one line (rank 0's) and leaves a
``relaunch`` note for ``mpilearn-run``, which returns 75 and, with ``--min-np``, runs the job
again; a second later faulthandler's timer, a C thread that needs no interpreter lock, exits
the rank with status 1 (a signal would read as 0 under ULFM). ``mpilearn-run`` sees the ranks on its own machine die
and ends such a job at once (``cluster/startwatch.py``); this bound is for the ranks it cannot
see (other nodes) and for a plain ``mpirun --with-ft ulfm``. Once ``MPI_Init`` has returned,
a loss is MPI's to report: the survivors name it and exit 75 (``membership.outside_training``,
with the membership made at once: ``Membership.early``).

Each rank records its phases in the job's status file (``phase RANK PID WORDS``: mpilearn-run
names the phase a lost rank was in, and knows which ranks are still starting when a stop
signal comes): :data:`MPI_INIT`, :data:`IMPORTS`, :data:`CONFIG`, :data:`MEMBERSHIP`, then
:data:`STARTED`; :data:`LEAVING` once its exit status is decided.
"""
from __future__ import annotations

import faulthandler
import os
import select
import signal
import sys
from typing import Optional

START_TIMEOUT_ENV = "MPILEARN_START_TIMEOUT"
DEFAULT_START_TIMEOUT = 120.0

# the phases, as the lines name them ("during start-up (PHASE)")
MPI_INIT = "MPI's initialisation"
IMPORTS = "the imports"
CONFIG = "reading the config"
MEMBERSHIP = "joining the membership"
STARTED = "started"   # start-up is over: a loss from here is the training loop's to survive
LEAVING = "leaving"   # the rank's exit status is decided: its end is not a loss
GAVE_UP = "gave up its start-up after"  # how the watcher's relaunch note begins


def ulfm(env=os.environ) -> bool:
    """Whether this process runs under ULFM (``mpirun --with-ft ulfm`` sets the MCA variable)."""
    return env.get("OMPI_MCA_mpi_ft_enable", "").strip().lower() in (
        "1", "true", "t", "yes", "y", "enabled")


def start_timeout(env=os.environ) -> float:
    """The bound in seconds (``MPILEARN_START_TIMEOUT``; 0 or less: none)."""
    value = env.get(START_TIMEOUT_ENV, "").strip()
    if not value:
        return DEFAULT_START_TIMEOUT
    try:
        return float(value)
    except ValueError:
        sys.stderr.write(f"mpilearn: {START_TIMEOUT_ENV}={value!r} is not a number of seconds; "
                         f"using {DEFAULT_START_TIMEOUT:g}\n")
        return DEFAULT_START_TIMEOUT


def spawned(env=os.environ) -> bool:
    """A process that a running job spawned (Open MPI names its parent's port): it joins a
    job that has started already, so it has no start-up of the job's to record or bound."""
    return "OMPI_PARENT_PORT" in env


class Guard:
    """This rank's start-up: :meth:`phase` at each boundary, :meth:`mpi_up` once ``MPI_Init``
    returned (the bound ends), :meth:`started` at the end."""

    def __init__(self, rank: int, seconds: float, watch: bool):
        self.rank, self.seconds = rank, seconds
        self.record = not spawned()
        self._pipe: Optional[int] = None  # the watcher's: closed, the watcher ends quietly
        self._devnull = None  # where faulthandler's dump goes (kept open while it is armed)
        if watch and seconds > 0 and self.record:
            self._bound()
        self.phase(MPI_INIT)

    def phase(self, words: str) -> None:
        if self.record:
            from .comm import record_phase

            record_phase(self.rank, os.getpid(), words)

    def mpi_up(self) -> None:
        """``MPI_Init`` returned: from here MPI reports a lost rank; the bound ends."""
        if self._pipe is not None:
            faulthandler.cancel_dump_traceback_later()
            self._devnull.close()
            os.close(self._pipe)  # the watcher reads the end of its pipe and exits
            self._pipe = self._devnull = None

    def started(self) -> None:
        self.mpi_up()
        self.phase(STARTED)

    def leaving(self) -> None:
        self.mpi_up()
        self.phase(LEAVING)

    def _bound(self) -> None:
        """A watcher process says it at the bound, one line and a note for ``mpilearn-run``,
        while the rank still runs (its output reaches the launcher through the rank's); then
        faulthandler's timer (a C thread: it needs no interpreter lock) ends the rank with
        status 1, :data:`EXIT_LAG` seconds later."""
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the watcher: never returns into the rank's code
            try:
                os.close(write_end)
                _watch(read_end, self.rank, self.seconds)
            finally:
                os._exit(0)
        os.close(read_end)
        self._pipe = write_end
        self._devnull = open(os.devnull, "w")
        faulthandler.dump_traceback_later(self.seconds + EXIT_LAG, exit=True,
                                          file=self._devnull)


EXIT_LAG = 1.0  # seconds from the watcher's line to the rank's end


def _watch(read_end: int, rank: int, seconds: float) -> None:
    """In the watcher process: the pipe ends before the bound (``MPI_Init`` returned, or the
    rank is gone: the kernel closes it), or the bound comes first: say so."""
    # a signal meant for the job (a terminal's Ctrl-C, srun's SIGTERM to every process) is the
    # rank's; the watcher stays until the pipe ends or the bound
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    ready, _, _ = select.select([read_end], [], [], seconds)
    if ready:
        return  # closed (nothing is ever written)
    reason = (f"{GAVE_UP} {seconds:g} s in {MPI_INIT}, which waits for every rank: a rank "
              "was lost, or never started, before it joined")
    if rank == 0:  # one line: every rank waits there alike
        try:
            sys.stderr.write(f"mpilearn: {reason}; nothing trained was lost: run it again with "
                             f"--resume auto (the bound: {START_TIMEOUT_ENV}, mpilearn-run "
                             "--start-timeout)\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        from .comm import record_relaunch

        record_relaunch(reason)


def arm() -> Guard:
    """This rank's start-up guard, before MPI starts (the top of ``train``'s main): its
    phases recorded; under ULFM, the watcher that bounds ``MPI_Init``."""
    from ..cluster.launcher import detect

    return Guard(detect().rank or 0, start_timeout(), watch=ulfm())
